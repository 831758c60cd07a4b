// CUDA int4_group into Marlin's layout (kernels/marlin_layout.h), in one pass over the weight: a
// block quantizes 64 outputs x 128 inputs into shared memory, then writes the packed words those
// make. The arithmetic is scalar_ops.h's, so the bits are the CPU kernel's.
#include <algorithm>

#include "kernels/cuda/common.cuh"
#include "kernels/gptq.h"
#include "kernels/internal.h"
#include "kernels/marlin_layout.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {
namespace {

constexpr int kWarp = 32;
constexpr int kBlockN = static_cast<int>(marlin::kChunkN);  // outputs per block: one chunk per 16 inputs
constexpr int kBlockThreads = 256;
constexpr int kWarps = kBlockThreads / kWarp;
constexpr int kWordsPerTile = kBlockN * static_cast<int>(marlin::kTile) / 8;  // 128 per 16 inputs

// One block per (matrix, group of 128 inputs, 64 outputs). Each warp takes 8 outputs: their
// coalesced reads of 128 inputs (4 a lane) all issued, then per output the group's amax and scale
// and the codes into shared memory. Then every packed word of the 8 x 1024-element chunks these
// make, gathered from shared memory and written in order.
template <DType D>
__global__ void __launch_bounds__(kBlockThreads) marlin_kernel(const void* in, MarlinArgs a) {
  // [n][k] of this block, uint4b8 bytes, 4 a word. Rows padded by 3 words: a warp's gathers, whose
  // outputs differ, then share a bank two ways at most (eight ways unpadded), and the writes, one
  // row a warp, none.
  __shared__ uint32_t codes[kBlockN][kGroupSize / 4 + 3];
  const int groups = static_cast<int>(a.k / kGroupSize), chunks = static_cast<int>(a.n / kBlockN);
  const int64_t chunk0 = a.n0 / kBlockN;  // the first chunk of outputs this call writes
  const int64_t blk = blockIdx.x;
  const int chunk = static_cast<int>(blk % chunks), g = static_cast<int>((blk / chunks) % groups);
  const int64_t m = blk / (static_cast<int64_t>(chunks) * groups);
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  uint16_t* scales = a.scale + m * groups * a.n_total;
  constexpr int kRowsPerWarp = kBlockN / kWarps;
  float v[kRowsPerWarp][4];
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {  // every load issued before any use
    const int64_t n = static_cast<int64_t>(chunk) * kBlockN + warp * kRowsPerWarp + i;  // of this call's input
    const int64_t at = (m * a.n + n) * a.k + static_cast<int64_t>(g) * kGroupSize + 4 * lane;
#pragma unroll
    for (int e = 0; e < 4; ++e) v[i][e] = load1<D>(in, at + e);
  }
#pragma unroll
  for (int i = 0; i < kRowsPerWarp; ++i) {
    const int nl = warp * kRowsPerWarp + i;
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < 4; ++e) amax = fmaxf(amax, ops::finite_abs(v[i][e]));
    for (int o = kWarp / 2; o > 0; o /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, o));
    const uint16_t s = ops::int4_scale_bits(amax, a.scale_bf16);
    if (lane == 0)
      scales[marlin::scale_index(g, a.n0 + static_cast<int64_t>(chunk) * kBlockN + nl, groups, a.n_total)] = s;
    const float scale = ops::scale_value(s, a.scale_bf16);
    uint32_t four = 0;
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      four |=
          static_cast<uint32_t>(ops::quant_int(v[i][e], scale, -8.0f, 7.0f) + static_cast<int32_t>(marlin::kZeroPoint))
          << (8 * e);
    }
    codes[nl][lane] = four;
  }
  __syncthreads();
  const int64_t words = 2 * a.n_total, tiles = a.k / marlin::kTile;
  constexpr int kTilesPerGroup = static_cast<int>(kGroupSize / marlin::kTile);
  // A thread keeps one word column of the chunk, whose eight elements sit at the same places in
  // every row of words: their positions are worked out once.
  const int cl = threadIdx.x % kWordsPerTile;
  int nls[8], kks[8];
#pragma unroll
  for (int q = 0; q < 8; ++q) marlin::chunk_element(marlin::weight_perm(8 * cl + q), nls[q], kks[q]);
  for (int rl = threadIdx.x / kWordsPerTile; rl < kTilesPerGroup; rl += kBlockThreads / kWordsPerTile) {
    uint32_t word = 0;
#pragma unroll
    for (int q = 0; q < 8; ++q) {
      const int kl = rl * static_cast<int>(marlin::kTile) + kks[q];
      word |= ((codes[nls[q]][kl / 4] >> (8 * (kl % 4))) & 0xFu) << (4 * q);
    }
    const int64_t r = static_cast<int64_t>(g) * kTilesPerGroup + rl;
    a.out[(m * tiles + r) * words + (chunk0 + chunk) * kWordsPerTile + cl] = static_cast<int32_t>(word);
  }
}

template <DType D>
Status launch(const MarlinArgs& a, cudaStream_t st) {
  const int64_t blocks = a.batch * (a.k / kGroupSize) * (a.n / kBlockN);
  if (blocks == 0) return ok_status();
  marlin_kernel<D><<<static_cast<unsigned>(blocks), kBlockThreads, 0, st>>>(a.in, a);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

// gptq_reload into Marlin's layout: one thread per word, its eight codes gathered from the
// checkpoint's packed rows through the sort permutation (a.perm, on the device).
__global__ void __launch_bounds__(kThreads) gptq_marlin_words_kernel(GptqArgs a, int64_t total) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (t >= total) return;
  const int64_t words = 2 * a.n, c = t % words, r = t / words;
  uint32_t word = 0;
#pragma unroll
  for (int q = 0; q < 8; ++q) {
    const int64_t p = 8 * c + q;
    int64_t col;
    int kk;
    marlin::word_element(p, marlin::weight_perm(static_cast<int>(p % marlin::kPermChunk)), col, kk);
    const int64_t src = a.perm[r * marlin::kTile + kk];
    word |= ((static_cast<uint32_t>(a.qweight[(src / kGptqPackFactor) * a.n + col]) >> (4 * (src % kGptqPackFactor))) &
             0xFu)
            << (4 * q);
  }
  a.out_qweight[t] = static_cast<int32_t>(word);
}

// The scales converted to the model's dtype, into their permuted places; g_idx in sorted order.
__global__ void __launch_bounds__(kThreads) gptq_marlin_side_kernel(GptqArgs a) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t groups = a.k / kGroupSize;
  if (i < groups * a.n) {
    const uint16_t h = a.scales[i];
    a.out_scales[marlin::scale_index(i / a.n, i % a.n, groups, a.n)] = ops::f16_scale_as(h, a.scale_bf16);
  }
  if (i < a.k) a.out_g_idx[i] = a.g_idx[a.perm[i]];
}

}  // namespace

Status gptq_marlin(const GptqArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  const int64_t words = a.k / marlin::kTile * 2 * a.n;
  gptq_marlin_words_kernel<<<static_cast<unsigned>((words + kThreads - 1) / kThreads), kThreads, 0, st>>>(a, words);
  FERRY_CUDA_LAUNCH_CHECK();
  const int64_t side = std::max<int64_t>(a.k / kGroupSize * a.n, a.k);
  gptq_marlin_side_kernel<<<static_cast<unsigned>((side + kThreads - 1) / kThreads), kThreads, 0, st>>>(a);
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

Status marlin_quantize(const MarlinArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  return by_float_dtype(a.in_dtype, [&](auto d) { return launch<decltype(d)::value>(a, st); });
}

}  // namespace ferry::kernels::detail::cuda

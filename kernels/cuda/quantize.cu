// CUDA quantize kernels: dispatch, fp8_block, int4_group and none; the row-scaled schemes are in
// quantize_rows.cu. Every kernel reads its input once (fp8_per_tensor twice: amax, then encode).
#include <cuda_fp16.h>

#include <map>
#include <mutex>
#include <string>
#include <type_traits>
#include <utility>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/fast_quant.cuh"
#include "kernels/cuda/quantize_kernels.cuh"
#include "kernels/internal.h"
#include "kernels/scalar_ops.h"

namespace ferry::kernels::detail::cuda {

unsigned persistent_blocks(const void* kernel, int64_t work_blocks, size_t smem) {
  static std::mutex mu;
  static std::map<std::pair<const void*, int>, int> cache;  // (kernel, device) -> SMs x blocks per SM
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess) dev = 0;
  int slots = 0;
  {
    std::lock_guard<std::mutex> lock(mu);
    auto it = cache.find({kernel, dev});
    if (it == cache.end()) {
      int sms = 0, per_sm = 0;
      if (cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev) != cudaSuccess) sms = 1;
      if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, smem) != cudaSuccess) per_sm = 1;
      it = cache.emplace(std::make_pair(kernel, dev), std::max(1, sms) * std::max(1, per_sm)).first;
    }
    slots = it->second;
  }
  return static_cast<unsigned>(std::max<int64_t>(1, std::min<int64_t>(work_blocks, slots)));
}

namespace {

// f32 -> f16 by the hardware conversion (IEEE, nearest even, subnormals kept: ferry builds without
// fast math), except NaN: the storage's quiet NaN with its sign, as f32_to_f16 gives.
__device__ __forceinline__ uint16_t to_f16(float x) {
  const uint32_t u = __float_as_uint(x);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u);
  return __half_as_ushort(__float2half_rn(x));
}

// fp8_block with 16-byte vectors: one block per 128x128 tile, kRowsPerStep rows of the tile per step
// of its threads, each thread loading all of its kPer vectors before using any and keeping them raw.
// Registers are capped so that four blocks fit an SM (bf16, f16; two of twice the threads for f32).
// Finite tiles take fp8_encode_fast (the division's fast path, or the engines' x * (1 / s)); a tile
// with an inf or NaN, or a scale out of that path's range, takes ops::quant_fp8 per element.
// H200, 8192 x 8192 bf16, ratio to the device copy (bench/gpu/block_probe.cu): 0.58 with a
// grid-stride loop, 64-bit offsets and the division per element (85 registers, three blocks per SM);
// 0.81 with the fast encode; 0.93 with four blocks per SM (six: 0.74, spilling; 512 threads of 4
// vectors: 0.81 to 0.92; persistent blocks that load the next tile while encoding one: 0.82). Qwen3
// expert stacks [128, 1536, 2048] and [128, 2048, 768]: 1.02 and 1.00 (0.61 and 0.60 before).
template <DType D>
inline constexpr int kBlockThreads = D == DType::kF32 ? 512 : 256;

struct BlockParams {
  const void* in;
  uint8_t* out;
  float* scale;
  int64_t mrows;  // rows of one matrix (the input is a stack of them)
  int64_t cols;
  ops::Fp8Rule fp8;
};

template <DType D>
__global__ void __launch_bounds__(kBlockThreads<D>, D == DType::kF32 ? 2 : 4) block_vec_kernel(BlockParams p) {
  constexpr int T = kBlockThreads<D>, E = kPerVec<D>, kSize = D == DType::kF32 ? 4 : 2;
  constexpr int kRowVecs = kFp8BlockSize / E;         // vectors per tile row
  constexpr int kRowsPerStep = T / kRowVecs;           // 16
  constexpr int kPer = kFp8BlockSize / kRowsPerStep;  // vectors per thread: 8
  __shared__ float part[T / 32];
  __shared__ uint32_t part_bad[T / 32];
  const int64_t tile = blockIdx.x;
  const int64_t bcols = (p.cols + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t bands = (p.mrows + kFp8BlockSize - 1) / kFp8BlockSize;
  const int64_t band_all = tile / bcols, c0 = (tile % bcols) * kFp8BlockSize;
  const int64_t band_row = (band_all % bands) * kFp8BlockSize;
  const int rows = static_cast<int>(imin(kFp8BlockSize, p.mrows - band_row));
  const int col = static_cast<int>(threadIdx.x % kRowVecs) * E;
  const bool col_in = c0 + col < p.cols;  // cols % E == 0: a vector is all in or all out
  const int row0 = static_cast<int>(threadIdx.x / kRowVecs);
  const int64_t first = ((band_all / bands) * p.mrows + band_row) * p.cols + c0 + col;
  const char* src = static_cast<const char*>(p.in) + first * kSize;
  uint4 raw[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int r = row0 + j * kRowsPerStep;
    raw[j] = col_in && r < rows ? __ldcs(reinterpret_cast<const uint4*>(src + static_cast<int64_t>(r) * p.cols * kSize))
                                : make_uint4(0, 0, 0, 0);
  }
  uint32_t acc = 0;
#pragma unroll
  for (int j = 0; j < kPer; ++j) acc = magnitude_max<D>(acc, raw[j]);
  bool bad = false;
  float m = magnitude_value<D>(acc, bad);
  if (bad) m = vec_amax<D>(raw);  // the largest finite magnitude
  // The tile's max and whether any element is an inf or NaN: warp shuffles, one shared step.
  m = warp_max(m);
  const bool warp_bad = __any_sync(0xffffffffu, bad);
  if ((threadIdx.x & 31) == 0) {
    part[threadIdx.x >> 5] = m;
    part_bad[threadIdx.x >> 5] = warp_bad;
  }
  __syncthreads();
  uint32_t any_bad = 0;
#pragma unroll
  for (int w = 0; w < T / 32; ++w) {
    m = fmaxf(m, part[w]);
    any_bad |= part_bad[w];
  }
  const float s = ops::fp8_scale(m, p.fp8);
  if (threadIdx.x == 0) p.scale[tile] = s;
  const float inv = ops::fp8_multiplier(s, p.fp8);
  const float y = any_bad == 0 ? fp8_fast_multiplier(s, inv, p.fp8) : 0.0f;
  uint8_t* dst = p.out + first;
  auto encode = [&](auto mode) {  // 0: ops::quant_fp8; 1: fast division; 2: fast reciprocal
    constexpr int kMode = decltype(mode)::value;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int r = row0 + j * kRowsPerStep;
      if (!col_in || r >= rows) continue;
      uint8_t* o = dst + static_cast<int64_t>(r) * p.cols;
      if constexpr (kMode == 0) {
        float f[E];
        unpack<D>(raw[j], f);
        uint8_t b[E];
#pragma unroll
        for (int e = 0; e < E; ++e) b[e] = ops::quant_fp8(f[e], s, inv, p.fp8);
        store_codes<E>(o, b);
      } else {
        fp8_encode_fast<D, kMode == 2>(raw[j], s, y, o);
      }
    }
  };
  if (y == 0.0f) {
    encode(std::integral_constant<int, 0>{});
  } else if (p.fp8.reciprocal) {
    encode(std::integral_constant<int, 2>{});
  } else {
    encode(std::integral_constant<int, 1>{});
  }
}

// ops::int4_scale_f16 with the hardware's conversion (to_f16 above), which gives the same bits
// (amax / 7 is finite and non-negative; both round to nearest even, overflow to inf and keep
// subnormals): every lane of a group computes its scale, and the software conversion costs those
// lanes more than their codes.
__device__ __forceinline__ uint16_t int4_scale_f16_hw(float amax) {
  const uint16_t h = to_f16(amax / 7.0f);
  return h == 0 ? ops::kF16One : (h >= ops::kF16Inf ? ops::kF16Max : h);
}

// The codes of one lane's 16 elements of a group whose amax is m, at `o`; the group's scale too when
// `scale` is given (one lane of the group).
__device__ __forceinline__ void int4_encode_slice(const float (&v)[kVec], float m, uint16_t* scale, uint8_t* o,
                                                  bool vec_out) {
  const uint16_t s16 = int4_scale_f16_hw(m);
  if (scale != nullptr) *scale = s16;
  const float s = __half2float(__ushort_as_half(s16));
  const float rs = fast_recip(s);
  uint32_t lo = 0, hi = 0;
#pragma unroll
  for (int j = 0; j < 8; ++j) lo |= static_cast<uint32_t>(quant_int_fast(v[j], s, rs, -8.0f, 7.0f) & 0xF) << (4 * j);
#pragma unroll
  for (int j = 0; j < 8; ++j) hi |= static_cast<uint32_t>(quant_int_fast(v[8 + j], s, rs, -8.0f, 7.0f) & 0xF) << (4 * j);
  if (vec_out) {
    __stcs(reinterpret_cast<uint2*>(o), make_uint2(lo, hi));
  } else {
    for (int j = 0; j < 4; ++j) o[j] = static_cast<uint8_t>(lo >> (8 * j));
    for (int j = 0; j < 4; ++j) o[4 + j] = static_cast<uint8_t>(hi >> (8 * j));
  }
}

// Eight lanes per 128-column group, 16 columns each; the group's amax is reduced over the 8 lanes.
// Grid-stride over the lanes' slices (the bound is uniform per warp: the shuffles need all lanes).
template <DType D>
__global__ void __launch_bounds__(kThreads) int4_kernel(const void* in, uint8_t* out, uint16_t* scale,
                                                        int64_t total_groups, bool vec_in, bool vec_out) {
  const int64_t slices = total_groups * 8;
  for (int64_t t0 = static_cast<int64_t>(blockIdx.x) * blockDim.x; t0 < slices;
       t0 += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t t = t0 + threadIdx.x;
    const int64_t g = t / 8;
    const int lane8 = static_cast<int>(t % 8);
    const bool active = g < total_groups;
    // Groups tile the rows exactly (cols % 128 == 0): slice t starts at element 16 t.
    const int64_t i = t * kVec;
    float v[kVec];
    float m = 0.0f;
    load16<D>(in, active ? i : 0, vec_in && active, active ? kVec : 0, v);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m = fmaxf(m, ops::finite_abs(v[j]));
#pragma unroll
    for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    if (active) int4_encode_slice(v, m, lane8 == 0 ? scale + g : nullptr, out + i / 2, vec_out);
  }
}

// int4_group of 16-byte aligned bf16: one slice (16 elements, two raw 16-byte loads, the integer
// amax of fast_quant.cuh) per thread, launched in waves. Kept apart from int4_kernel for its
// registers: 27 against 39 there, so eight blocks of 256 threads fit an SM instead of six, and a
// third more loads are in flight (H200: 0.76 of the device copy against 0.71; two, three or four
// slices per thread, all loaded first: 0.75, 0.72, 0.61; a persistent grid loading the next
// slice ahead: 0.66).
__global__ void __launch_bounds__(kThreads) int4_bf16_kernel(const uint16_t* in, uint8_t* out, uint16_t* scale,
                                                             int64_t total_groups, bool vec_out) {
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  const int64_t g = t / 8;
  const bool active = g < total_groups;  // whole warps share the shuffles below, active or not
  const uint4* src = reinterpret_cast<const uint4*>(in + (active ? t * kVec : 0));
  const uint4 raw[2] = {active ? __ldcs(src) : make_uint4(0, 0, 0, 0), active ? __ldcs(src + 1) : make_uint4(0, 0, 0, 0)};
  float m = vec_amax<DType::kBF16>(raw);
#pragma unroll
  for (int o = 4; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if (!active) return;
  float v[kVec];
  unpack<DType::kBF16>(raw[0], *reinterpret_cast<float(*)[8]>(v));
  unpack<DType::kBF16>(raw[1], *reinterpret_cast<float(*)[8]>(v + 8));
  int4_encode_slice(v, m, t % 8 == 0 ? scale + g : nullptr, out + t * kVec / 2, vec_out);
}

// Dtype conversion, 16 elements per thread.
template <DType D, DType O>
__global__ void __launch_bounds__(kThreads) none_kernel(const void* in, void* out, int64_t n, bool vec) {
  const int64_t i = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
  if (i >= n) return;
  const int cnt = static_cast<int>(imin(kVec, n - i));
  const bool full = vec && cnt == kVec;
  float v[kVec];
  load16<D>(in, i, full, cnt, v);
  if constexpr (O == DType::kF32) {
    // NaN to the quiet NaN with its sign, as on the CPU: widening a bf16 alone keeps its payload.
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const uint32_t u = __float_as_uint(v[j]);
      if ((u & 0x7fffffffu) > 0x7f800000u) v[j] = __uint_as_float((u & 0x80000000u) | 0x7fc00000u);
    }
    float* o = static_cast<float*>(out) + i;
    if (full) {
#pragma unroll
      for (int j = 0; j < 4; ++j) reinterpret_cast<float4*>(o)[j] = make_float4(v[4 * j], v[4 * j + 1], v[4 * j + 2], v[4 * j + 3]);
    } else {
      for (int j = 0; j < cnt; ++j) o[j] = v[j];
    }
  } else {
    uint16_t h[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) h[j] = O == DType::kBF16 ? ops::to_bf16(v[j]) : to_f16(v[j]);
    uint16_t* o = static_cast<uint16_t*>(out) + i;
    if (full) {
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        uint4 u;
        u.x = h[8 * j + 0] | (static_cast<uint32_t>(h[8 * j + 1]) << 16);
        u.y = h[8 * j + 2] | (static_cast<uint32_t>(h[8 * j + 3]) << 16);
        u.z = h[8 * j + 4] | (static_cast<uint32_t>(h[8 * j + 5]) << 16);
        u.w = h[8 * j + 6] | (static_cast<uint32_t>(h[8 * j + 7]) << 16);
        reinterpret_cast<uint4*>(o)[j] = u;
      }
    } else {
      for (int j = 0; j < cnt; ++j) o[j] = h[j];
    }
  }
}

unsigned blocks_for(int64_t work, int64_t per_block) { return static_cast<unsigned>((work + per_block - 1) / per_block); }

template <DType D>
Status launch_none(const QuantArgs& a, cudaStream_t st) {
  const int64_t n = a.rows * a.cols;
  if (n == 0) return ok_status();  // an empty grid is a launch error
  if (a.out_dtype == D) {
    FERRY_CUDA_CHECK(cudaMemcpyAsync(a.out, a.in, dtype_bytes(D, n), cudaMemcpyDeviceToDevice, st));
    return ok_status();
  }
  const bool vec = aligned16(a.in) && aligned16(a.out);
  const unsigned blocks = blocks_for(n, int64_t{kThreads} * kVec);
  if (a.out_dtype == DType::kF32) {
    none_kernel<D, DType::kF32><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  } else if (a.out_dtype == DType::kBF16) {
    none_kernel<D, DType::kBF16><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  } else {
    none_kernel<D, DType::kF16><<<blocks, kThreads, 0, st>>>(a.in, a.out, n, vec);
  }
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status launch_block(const QuantArgs& a, cudaStream_t st) {
  constexpr int E = kPerVec<D>;
  const bool vec = aligned16(a.in) && (a.cols * (D == DType::kF32 ? 4 : 2)) % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(a.out) % E == 0;
  if (!vec) return generic_block(a, st);
  const int64_t batch = a.matrix_rows > 0 ? a.rows / a.matrix_rows : 0;
  const int64_t tiles = batch * ((a.matrix_rows + kFp8BlockSize - 1) / kFp8BlockSize) *
                        ((a.cols + kFp8BlockSize - 1) / kFp8BlockSize);
  if (tiles == 0) return ok_status();
  if (tiles >= int64_t{1} << 31) {  // one block per tile: 2^31 tiles are 64 TiB of bf16
    return Status::invalid_argument("quantize fp8_block: " + std::to_string(tiles) + " tiles of 128 x 128, more than a grid holds");
  }
  block_vec_kernel<D><<<static_cast<unsigned>(tiles), kBlockThreads<D>, 0, st>>>(
      {a.in, static_cast<uint8_t*>(a.out), static_cast<float*>(a.scale), a.matrix_rows, a.cols, a.fp8});
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status launch_int4(const QuantArgs& a, cudaStream_t st) {
  const int64_t groups = a.rows * (a.cols / kGroupSize);
  if (groups == 0) return ok_status();
  if (D == DType::kBF16 && aligned16(a.in) && groups * 8 / kThreads < (int64_t{1} << 30)) {  // one slice a thread
    const int64_t slices = groups * 8;
    int4_bf16_kernel<<<static_cast<unsigned>((slices + kThreads - 1) / kThreads), kThreads, 0, st>>>(
        static_cast<const uint16_t*>(a.in), static_cast<uint8_t*>(a.out), static_cast<uint16_t*>(a.scale), groups,
        aligned8(a.out));
    FERRY_CUDA_LAUNCH_CHECK();
    return ok_status();
  }
  const auto kernel = int4_kernel<D>;
  const unsigned blocks = static_cast<unsigned>(std::min<int64_t>(blocks_for(groups * 8, kThreads), int64_t{1} << 30));
  kernel<<<blocks, kThreads, 0, st>>>(a.in, static_cast<uint8_t*>(a.out), static_cast<uint16_t*>(a.scale), groups,
                                      aligned16(a.in), aligned8(a.out));
  FERRY_CUDA_LAUNCH_CHECK();
  return ok_status();
}

template <DType D>
Status launch(const QuantArgs& a, cudaStream_t st) {
  // An engine layout's fp8 arithmetic (a.fp8) goes to the same kernels: the row kernels, the
  // per-tensor pair and the block kernel take any rule (fp8_per_tensor's one-kernel path takes
  // ferry's only).
  switch (a.scheme) {
    case Scheme::kNone: return launch_none<D>(a, st);
    case Scheme::kFp8PerChannel: return quantize_per_channel(a, false, st);
    case Scheme::kInt8PerChannel: return quantize_per_channel(a, true, st);
    case Scheme::kFp8PerTensor: return quantize_per_tensor(a, st);
    case Scheme::kFp8Block: return launch_block<D>(a, st);
    case Scheme::kInt4Group: return launch_int4<D>(a, st);
    case Scheme::kGptqInt4: break;
  }
  return Status::invalid_argument("quantize: gptq_int4 is a quantized reload");
}

}  // namespace

Status quantize(const QuantArgs& a, void* stream) {
  const cudaStream_t st = as_stream(stream);
  return by_float_dtype(a.in_dtype, [&](auto d) { return launch<decltype(d)::value>(a, st); });
}

}  // namespace ferry::kernels::detail::cuda

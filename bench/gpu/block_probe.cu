// block_probe: fp8_block (128 x 128 tiles, one f32 scale each) kernel shapes side by side, on the
// 8192 x 8192 bf16 matrix of `ferry bench kernels` and on stacked expert shapes (Qwen3-30B-A3B's
// w13 [128, 1536, 2048] and w2 [128, 2048, 768]), to choose the shape of ferry's CUDA kernel from
// measurements. Every variant's codes and scales are compared byte for byte with "cur" (the shape
// ferry's kernel had when this probe was written, bit-exact with the CPU kernel), on inputs where
// every other tile's scale is exactly 1 (rounding ties common) and a few tiles hold an inf or NaN.
//   nvcc -O3 -std=c++20 -I. -gencode=arch=compute_90,code=sm_90 -o block_probe bench/gpu/block_probe.cu
// Prints one JSON line per (shape, variant): GB/s of bytes read plus written, the ratio to a
// device-to-device cudaMemcpy of the input in the same run, and the bytes that differ from "cur".
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <type_traits>
#include <vector>

#include "bench/gpu/probe_util.cuh"
#include "bench/gpu/quant_probe_kernels.cuh"

namespace {

constexpr int kB = 128;  // tile side

__device__ __forceinline__ uint32_t cvt2(float hi, float lo) {
  uint16_t r;
  asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(r) : "f"(hi), "f"(lo));
  return r;
}

// The block's max, every thread gets it: warp shuffles, one shared step. `flag`: whether any
// thread passed a true `any`.
template <int kThreadsB>
__device__ __forceinline__ float tile_max(float v, float* part, bool any = false, bool* flag = nullptr,
                                          uint32_t* part_flag = nullptr) {
  v = warp_max(v);
  const bool a = part_flag != nullptr && __any_sync(0xffffffffu, any);
  if ((threadIdx.x & 31) == 0) {
    part[threadIdx.x >> 5] = v;
    if (part_flag != nullptr) part_flag[threadIdx.x >> 5] = a;
  }
  __syncthreads();
  float m = part[0];
  uint32_t f = part_flag != nullptr ? part_flag[0] : 0;
#pragma unroll
  for (int w = 1; w < kThreadsB / 32; ++w) {
    m = fmaxf(m, part[w]);
    if (part_flag != nullptr) f |= part_flag[w];
  }
  if (flag != nullptr) *flag = f != 0;
  return m;
}

// The 8 codes of a vector by the division's fast path (quantize_tensor.cu's encode, valid for s in
// [2^-60, 2^60] and finite elements), or ops::quant_fp8 per element.
template <bool kFast>
__device__ __forceinline__ void encode(const uint4& raw, float s, float y, uint8_t* dst) {
  float f[8];
  unpack8(raw, f);
  uint32_t lo, hi;
  if constexpr (kFast) {
    float v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float q = f[e] * y;
      v[e] = copysignf(fmaf(fmaf(-s, q, f[e]), y, q), f[e]);
    }
    lo = cvt2(v[1], v[0]) | (cvt2(v[3], v[2]) << 16);
    hi = cvt2(v[5], v[4]) | (cvt2(v[7], v[6]) << 16);
  } else {
    uint8_t b[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) b[e] = ops::quant_fp8(f[e], s);
    lo = b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<uint32_t>(b[3]) << 24);
    hi = b[4] | (b[5] << 8) | (b[6] << 16) | (static_cast<uint32_t>(b[7]) << 24);
  }
  __stcs(reinterpret_cast<uint2*>(dst), make_uint2(lo, hi));
}

// "cur": ferry's block_vec_kernel<bf16> when the probe was written.
__global__ void __launch_bounds__(kT) cur_kernel(const void* in, uint8_t* out, float* scale, int64_t mrows,
                                                 int64_t cols, int64_t tiles) {
  constexpr int E = 8, kRowVecs = kB / E, kPer = kB * kRowVecs / kT;
  const int64_t bcols = (cols + kB - 1) / kB;
  const int64_t bands = (mrows + kB - 1) / kB;
  __shared__ float part[kT / 32];
  for (int64_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const int64_t band_all = tile / bcols, bc = tile % bcols;
    const int64_t mat = band_all / bands;
    const int64_t r0 = mat * mrows + (band_all % bands) * kB;
    const int64_t r_end = mat * mrows + mrows;
    const int64_t c0 = bc * kB;
    uint4 raw[kPer];
    int64_t at[kPer];
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int v = j * kT + static_cast<int>(threadIdx.x);
      const int64_t r = r0 + v / kRowVecs, c = c0 + static_cast<int64_t>(v % kRowVecs) * E;
      at[j] = r < r_end && c < cols ? r * cols + c : -1;
      raw[j] = at[j] >= 0 ? __ldcs(reinterpret_cast<const uint4*>(static_cast<const char*>(in) + at[j] * 2))
                          : make_uint4(0, 0, 0, 0);
    }
    const float s = ops::fp8_scale(tile_max<kT>(amax_bits(raw), part));
    __syncthreads();
    if (threadIdx.x == 0) scale[tile] = s;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      if (at[j] < 0) continue;
      encode<false>(raw[j], s, 0.0f, out + at[j]);
    }
  }
}

// Candidates: kThreadsB threads per tile (kPer = 2048 / kThreadsB vectors each), at least kMinBlocks
// blocks per SM (registers capped to fit), 32-bit offsets inside the tile, one block per tile (no
// grid-stride loop), and the division's fast path when the tile is finite and its scale in range.
template <int kThreadsB, int kMinBlocks, bool kFastEnc>
__global__ void __launch_bounds__(kThreadsB, kMinBlocks) cand_kernel(const void* in, uint8_t* out, float* scale,
                                                                      int64_t mrows, int64_t cols) {
  constexpr int E = 8, kRowVecs = kB / E, kPer = kB * kRowVecs / kThreadsB;
  constexpr int kRowsPerStep = kThreadsB / kRowVecs;
  __shared__ float part[kThreadsB / 32];
  __shared__ uint32_t part_flag[kThreadsB / 32];
  const int64_t tile = blockIdx.x;
  const int64_t bcols = (cols + kB - 1) / kB;
  const int64_t bands = (mrows + kB - 1) / kB;
  const int64_t band_all = tile / bcols, bc = tile % bcols;
  const int64_t mat = band_all / bands;
  const int64_t band_row = (band_all % bands) * kB;
  const int rows_here = static_cast<int>(mrows - band_row < kB ? mrows - band_row : kB);
  const int64_t c0 = bc * kB;
  const int col = static_cast<int>(threadIdx.x % kRowVecs) * E;
  const bool col_in = c0 + col < cols;
  const int row0 = static_cast<int>(threadIdx.x / kRowVecs);
  const char* base = static_cast<const char*>(in) + ((mat * mrows + band_row) * cols + c0 + col) * 2;
  uint8_t* obase = out + (mat * mrows + band_row) * cols + c0 + col;
  uint4 raw[kPer];
#pragma unroll
  for (int j = 0; j < kPer; ++j) {
    const int r = row0 + j * kRowsPerStep;
    raw[j] = col_in && r < rows_here ? __ldcs(reinterpret_cast<const uint4*>(base + static_cast<int64_t>(r) * cols * 2))
                                     : make_uint4(0, 0, 0, 0);
  }
  const uint32_t m16 = max_bits(raw);
  const bool bad = m16 >= 0x7F80u;
  const float m = bad ? amax_bits(raw) : __uint_as_float(m16 << 16);
  bool nonfinite = false;
  const float s = ops::fp8_scale(tile_max<kThreadsB>(m, part, bad, &nonfinite, part_flag));
  if (threadIdx.x == 0) scale[tile] = s;
  auto run = [&](auto fast_v, float y) {
    constexpr bool kF = decltype(fast_v)::value;
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int r = row0 + j * kRowsPerStep;
      if (col_in && r < rows_here) encode<kF>(raw[j], s, y, obase + static_cast<int64_t>(r) * cols);
    }
  };
  if (kFastEnc && !nonfinite && s >= 0x1p-60f && s <= 0x1p60f) {
    float y0;
    asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(s));
    run(std::true_type{}, fmaf(y0, fmaf(-s, y0, 1.0f), y0));
  } else {
    run(std::false_type{}, 0.0f);
  }
}

// Persistent and pipelined: each block walks tiles blockIdx.x, + gridDim.x, ...; the loads of the
// next tile are issued before the current one is reduced and encoded.
template <int kThreadsB, int kMinBlocks>
__global__ void __launch_bounds__(kThreadsB, kMinBlocks) pipe_kernel(const void* in, uint8_t* out, float* scale,
                                                                      int64_t mrows, int64_t cols, int64_t tiles) {
  constexpr int E = 8, kRowVecs = kB / E, kPer = kB * kRowVecs / kThreadsB;
  constexpr int kRowsPerStep = kThreadsB / kRowVecs;
  __shared__ float part[2][kThreadsB / 32];
  __shared__ uint32_t part_flag[2][kThreadsB / 32];
  const int64_t bcols = (cols + kB - 1) / kB;
  const int64_t bands = (mrows + kB - 1) / kB;
  const int col = static_cast<int>(threadIdx.x % kRowVecs) * E;
  const int row0 = static_cast<int>(threadIdx.x / kRowVecs);
  struct Where {
    int64_t first;  // element offset of this thread's column in the tile's first row
    int rows;
    bool col_in;
  };
  auto where = [&](int64_t tile) {
    const int64_t band_all = tile / bcols, bc = tile % bcols;
    const int64_t mat = band_all / bands, band_row = (band_all % bands) * kB;
    Where w;
    w.rows = static_cast<int>(mrows - band_row < kB ? mrows - band_row : kB);
    w.col_in = bc * kB + col < cols;
    w.first = (mat * mrows + band_row) * cols + bc * kB + col;
    return w;
  };
  auto load = [&](const Where& w, uint4 (&raw)[kPer]) {
#pragma unroll
    for (int j = 0; j < kPer; ++j) {
      const int r = row0 + j * kRowsPerStep;
      raw[j] = w.col_in && r < w.rows
                   ? __ldcs(reinterpret_cast<const uint4*>(static_cast<const char*>(in) +
                                                           (w.first + static_cast<int64_t>(r) * cols) * 2))
                   : make_uint4(0, 0, 0, 0);
    }
  };
  int64_t tile = blockIdx.x;
  if (tile >= tiles) return;
  uint4 cur[kPer], nxt[kPer];
  Where wc = where(tile);
  load(wc, cur);
  for (int it = 0;; ++it) {
    const int64_t next = tile + gridDim.x;
    Where wn{};
    if (next < tiles) {
      wn = where(next);
      load(wn, nxt);
    }
    const uint32_t m16 = max_bits(cur);
    const bool bad = m16 >= 0x7F80u;
    const float m = bad ? amax_bits(cur) : __uint_as_float(m16 << 16);
    bool nonfinite = false;
    const float s = ops::fp8_scale(tile_max<kThreadsB>(m, part[it & 1], bad, &nonfinite, part_flag[it & 1]));
    if (threadIdx.x == 0) scale[tile] = s;
    uint8_t* obase = out + wc.first;
    auto run = [&](auto fast_v, float y) {
      constexpr bool kF = decltype(fast_v)::value;
#pragma unroll
      for (int j = 0; j < kPer; ++j) {
        const int r = row0 + j * kRowsPerStep;
        if (wc.col_in && r < wc.rows) encode<kF>(cur[j], s, y, obase + static_cast<int64_t>(r) * cols);
      }
    };
    if (!nonfinite && s >= 0x1p-60f && s <= 0x1p60f) {
      float y0;
      asm("rcp.approx.f32 %0, %1;" : "=f"(y0) : "f"(s));
      run(std::true_type{}, fmaf(y0, fmaf(-s, y0, 1.0f), y0));
    } else {
      run(std::false_type{}, 0.0f);
    }
    if (next >= tiles) break;
    tile = next;
    wc = wn;
#pragma unroll
    for (int j = 0; j < kPer; ++j) cur[j] = nxt[j];
  }
}

template <typename K>
unsigned occ_grid(K kernel, int threads) {
  int sms = 0, per = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, threads, 0));
  return static_cast<unsigned>(sms * (per > 0 ? per : 1));
}

struct Shape {
  const char* name;
  int64_t batch, mrows, cols;
};

}  // namespace

int main() {
  const Shape shapes[] = {{"8192x8192", 1, 8192, 8192},
                          {"qwen3_30b_w13", 128, 1536, 2048},
                          {"qwen3_30b_w2", 128, 2048, 768},
                          {"ragged_1000x1000", 1, 1000, 1000}};
  for (const Shape& sh : shapes) {
    const int64_t rows = sh.batch * sh.mrows, n = rows * sh.cols;
    const int64_t bands = (sh.mrows + kB - 1) / kB, bcols = (sh.cols + kB - 1) / kB;
    const int64_t tiles = sh.batch * bands * bcols;
    // Random sign, mantissa and exponent (2^-12 .. 2^2); every other tile gets a 448 (scale 1); the
    // first tiles of the third band get an inf, a NaN, and a zero tile.
    std::vector<uint16_t> h = random_bf16(n);
    for (int64_t t = 0; t < tiles; t += 2) {
      const int64_t bc = t % bcols, ba = t / bcols, mat = ba / bands, br = (ba % bands) * kB;
      h[(mat * sh.mrows + br) * sh.cols + bc * kB] = 0x43E0;  // 448
    }
    if (bands > 2 && sh.batch == 1) {
      h[(2 * kB) * sh.cols + 5] = 0x7F80;                       // inf
      if (bcols > 1) h[(2 * kB + 3) * sh.cols + kB + 7] = 0x7FC1;  // NaN
      if (bcols > 2)
        for (int r = 0; r < kB; ++r)
          for (int c = 0; c < kB; ++c) h[(2 * kB + r) * sh.cols + 2 * kB + c] = 0;
    }
    uint4 *in = nullptr, *copy = nullptr;
    uint8_t *out = nullptr, *ref = nullptr;
    float *scale = nullptr, *ref_scale = nullptr;
    CK(cudaMalloc(&in, n * 2));
    CK(cudaMalloc(&copy, n * 2));
    CK(cudaMalloc(&out, n));
    CK(cudaMalloc(&ref, n));
    CK(cudaMalloc(&scale, tiles * 4));
    CK(cudaMalloc(&ref_scale, tiles * 4));
    CK(cudaMemcpy(in, h.data(), n * 2, cudaMemcpyHostToDevice));
    const double base = time_ms([&] { CK(cudaMemcpyAsync(copy, in, n * 2, cudaMemcpyDeviceToDevice)); });
    const double base_gbps = 4.0 * n / base / 1e6;
    std::printf("{\"probe\":\"block\",\"shape\":\"%s\",\"case\":\"memcpy\",\"gbps\":%.1f,\"ratio\":1.0}\n", sh.name,
                base_gbps);
    const unsigned grid = static_cast<unsigned>(tiles);
    auto launch_cur = [&](uint8_t* o, float* s) { cur_kernel<<<grid, kT>>>(in, o, s, sh.mrows, sh.cols, tiles); };
    launch_cur(ref, ref_scale);
    CK(cudaDeviceSynchronize());
    std::vector<uint8_t> a(n), b(n);
    std::vector<float> sa(tiles), sb(tiles);
    auto diff = [&] {
      CK(cudaMemcpy(a.data(), ref, n, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(b.data(), out, n, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(sa.data(), ref_scale, tiles * 4, cudaMemcpyDeviceToHost));
      CK(cudaMemcpy(sb.data(), scale, tiles * 4, cudaMemcpyDeviceToHost));
      int64_t d = 0;
      for (int64_t i = 0; i < n; ++i) d += a[i] != b[i];
      return d + (std::memcmp(sa.data(), sb.data(), tiles * 4) != 0);
    };
    const double moved = 3.0 * n + 4.0 * tiles;
    auto one = [&](const char* name, const std::function<void(uint8_t*, float*)>& f) {
      CK(cudaMemset(out, 0xAA, n));
      const double ms = time_ms([&] { f(out, scale); });
      const double g = moved / ms / 1e6;
      std::printf("{\"probe\":\"block\",\"shape\":\"%s\",\"variant\":\"%s\",\"ms\":%.4f,\"gbps\":%.1f,\"ratio\":%.3f,"
                  "\"mismatches\":%lld}\n",
                  sh.name, name, ms, g, g / base_gbps, static_cast<long long>(diff()));
      std::fflush(stdout);
    };
#define CAND(T, MB, F)                                                                                  \
  one("t" #T "_occ" #MB "_" #F,                                                                         \
      [&](uint8_t* o, float* s) { cand_kernel<T, MB, F><<<grid, T>>>(in, o, s, sh.mrows, sh.cols); });
    one("cur", launch_cur);
    CAND(256, 1, false)
    CAND(256, 1, true)
    CAND(256, 4, true)
    CAND(256, 6, true)
    CAND(512, 1, true)
    CAND(512, 2, true)
    CAND(512, 3, true)
    CAND(1024, 1, true)
    CAND(1024, 2, true)
    CAND(128, 8, true)
#define PIPE(T, MB)                                                                             \
  one("pipe_t" #T "_occ" #MB, [&](uint8_t* o, float* s) {                                         \
    const unsigned g = occ_grid(pipe_kernel<T, MB>, T);                                           \
    pipe_kernel<T, MB><<<g < grid ? g : grid, T>>>(in, o, s, sh.mrows, sh.cols, tiles);             \
  });
    PIPE(256, 2)
    PIPE(256, 3)
    PIPE(512, 1)
    PIPE(512, 2)
    PIPE(1024, 1)
#undef PIPE
#undef CAND
    CK(cudaFree(in));
    CK(cudaFree(copy));
    CK(cudaFree(out));
    CK(cudaFree(ref));
    CK(cudaFree(scale));
    CK(cudaFree(ref_scale));
  }
  return 0;
}

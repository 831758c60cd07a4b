// quant_probe: variants of the row-scaled, per-tensor and int4 quantize kernels side by side on one
// 8192 x 8192 bf16 matrix, to choose the shape of ferry's CUDA kernels from measurements. Each
// variant's codes and scales are compared byte for byte with the "cur" variant (the shape ferry's
// kernels had when this probe was written, itself bit-exact with the CPU kernels), on inputs that
// make rounding ties common (rows and groups whose scale is exactly 1).
//   nvcc -O3 -std=c++20 -I. -gencode=arch=compute_90,code=sm_90 -o quant_probe bench/gpu/quant_probe.cu
// Prints one JSON line per variant: GB/s of bytes read plus written, the ratio to a device-to-device
// cudaMemcpy of the input in the same run, and the number of bytes that differ from "cur".
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <vector>

#include "bench/gpu/probe_util.cuh"
#include "bench/gpu/quant_probe_fused.cuh"
#include "bench/gpu/quant_probe_kernels.cuh"

template <typename K>
unsigned occupancy_grid(K kernel) {
  int sms = 0, per = 0;
  CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, kT, 0));
  return static_cast<unsigned>(sms * std::max(per, 1));
}

int main() {
  const int64_t rows = 8192, cols = 8192, n = rows * cols, nv = n / 8;
  const size_t in_bytes = n * 2;
  // Input: bf16 of random sign, mantissa and exponent (2^-12 .. 2^2); every other row (and group)
  // gets an element equal to 448 (fp8), 127 (int8) or 7 (int4) so its scale is exactly 1 and ties
  // to even are frequent.
  const std::vector<uint16_t> h = random_bf16(n);
  auto bf16 = [](float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    return static_cast<uint16_t>(u >> 16);
  };
  std::vector<uint16_t> h_fp8 = h, h_int8 = h, h_int4 = h;
  for (int64_t r = 0; r < rows; r += 2) {
    h_fp8[r * cols + (r % cols)] = bf16(448.0f);
    h_int8[r * cols + (r % cols)] = bf16(127.0f);
  }
  for (int64_t g = 0; g < n / 128; g += 2) h_int4[g * 128 + g % 128] = bf16(7.0f);
  uint4 *in = nullptr, *copy = nullptr;
  uint8_t *out = nullptr, *ref = nullptr;
  float *scale = nullptr, *ref_scale = nullptr;
  CK(cudaMalloc(&in, in_bytes));
  CK(cudaMalloc(&copy, in_bytes));
  CK(cudaMalloc(&out, n));
  CK(cudaMalloc(&ref, n));
  const size_t scale_bytes = size_t{4} << 20;  // int4's f16 per group is the most: 1 MiB
  CK(cudaMalloc(&scale, scale_bytes));
  CK(cudaMalloc(&ref_scale, scale_bytes));
  const double base = time_ms([&] { CK(cudaMemcpyAsync(copy, in, in_bytes, cudaMemcpyDeviceToDevice)); });
  const double base_gbps = 2.0 * in_bytes / base / 1e6;
  std::printf("{\"probe\":\"quant\",\"case\":\"memcpy\",\"gbps\":%.1f,\"ratio\":1.0}\n", base_gbps);
  std::vector<uint8_t> a(n), b(n);
  std::vector<float> sa(scale_bytes / 4), sb(scale_bytes / 4);
  auto diff = [&](size_t out_bytes, size_t scale_bytes) {
    CK(cudaMemcpy(a.data(), ref, out_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(b.data(), out, out_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sa.data(), ref_scale, scale_bytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(sb.data(), scale, scale_bytes, cudaMemcpyDeviceToHost));
    int64_t d = 0;
    for (size_t i = 0; i < out_bytes; ++i) d += a[i] != b[i];
    d += std::memcmp(sa.data(), sb.data(), scale_bytes) != 0;
    return d;
  };
  auto report = [&](const char* scheme, const char* variant, double ms, double moved, int64_t mismatches) {
    const double g = moved / ms / 1e6;
    std::printf("{\"probe\":\"quant\",\"case\":\"%s\",\"variant\":\"%s\",\"ms\":%.4f,\"gbps\":%.1f,\"ratio\":%.3f,"
                "\"mismatches\":%lld}\n",
                scheme, variant, ms, g, g / base_gbps, static_cast<long long>(mismatches));
    std::fflush(stdout);
  };
  const double row_moved = 3.0 * n + 4.0 * rows;
  const unsigned row_blocks = static_cast<unsigned>(rows);
  // Row-scaled schemes.
  auto rows_suite = [&](const char* scheme, const std::vector<uint16_t>& host, auto cur, auto... others) {
    CK(cudaMemcpy(in, host.data(), in_bytes, cudaMemcpyHostToDevice));
    cur.launch(ref, ref_scale);
    CK(cudaDeviceSynchronize());
    auto one = [&](const auto& v) {
      const double ms = time_ms([&] { v.launch(out, scale); });  // before the comparison reads `out`
      report(scheme, v.name, ms, row_moved, diff(n, rows * 4));
    };
    one(cur);
    (one(others), ...);
  };
  struct V {
    const char* name;
    std::function<void(uint8_t*, float*)> launch;
  };
  auto cur = [&](auto kernel, unsigned blocks) {
    return [=](uint8_t* o, float* s) { kernel<<<blocks, kT>>>(in, o, s, rows, cols / 8); };
  };
  rows_suite("fp8_per_channel", h_fp8, V{"cur", cur(rows_cur<kFp8Div, 256, 4>, row_blocks)},
             V{"cur_mul", cur(rows_cur<kFp8Mul, 256, 4>, row_blocks)},
             V{"tpr128_v8", cur(rows_cur<kFp8Div, 128, 8>, row_blocks / 2)},
             V{"tpr128_v8_mul", cur(rows_cur<kFp8Mul, 128, 8>, row_blocks / 2)},
             V{"pipe", cur(rows_pipe<kFp8Div, 4>, occupancy_grid(rows_pipe<kFp8Div, 4>))},
             V{"pipe_mul", cur(rows_pipe<kFp8Mul, 4>, occupancy_grid(rows_pipe<kFp8Mul, 4>))},
             V{"cur_occ8", cur(rows_cur<kFp8Div, 256, 4, 8>, row_blocks)},
             V{"cur_mul_occ8", cur(rows_cur<kFp8Mul, 256, 4, 8>, row_blocks)},
             V{"pipe_mul_occ6", cur(rows_pipe<kFp8Mul, 4, 6>, occupancy_grid(rows_pipe<kFp8Mul, 4, 6>))});
  rows_suite("int8_per_channel", h_int8, V{"cur", cur(rows_cur<kInt8Cur, 256, 4>, row_blocks)},
             V{"cur_new", cur(rows_cur<kInt8New, 256, 4>, row_blocks)},
             V{"tpr128_v8_new", cur(rows_cur<kInt8New, 128, 8>, row_blocks / 2)},
             V{"pipe", cur(rows_pipe<kInt8Cur, 4>, occupancy_grid(rows_pipe<kInt8Cur, 4>))},
             V{"pipe_new", cur(rows_pipe<kInt8New, 4>, occupancy_grid(rows_pipe<kInt8New, 4>))},
             V{"cur_new_occ8", cur(rows_cur<kInt8New, 256, 4, 8>, row_blocks)},
             V{"pipe_new_occ6", cur(rows_pipe<kInt8New, 4, 6>, occupancy_grid(rows_pipe<kInt8New, 4, 6>))});

  // fp8_per_tensor: both passes, then each alone.
  {
    CK(cudaMemcpy(in, h_fp8.data(), in_bytes, cudaMemcpyHostToDevice));
    const double moved = 3.0 * n + 4.0;
    const int64_t tail = std::max<int64_t>(0, nv - (int64_t{36} << 20) / 16);  // last 36 MiB kept in L2
    auto per_tensor = [&](auto amax, auto encode, unsigned amax_blocks, unsigned enc_blocks) {
      return [=](uint8_t* o, float* s) {
        cudaMemsetAsync(s, 0, 4);
        amax<<<amax_blocks, kT>>>(in, nv, tail, s);
        finalize<<<1, 1>>>(s);
        encode<<<enc_blocks, kT>>>(in, o, nv, s);
      };
    };
    const unsigned enc4 = static_cast<unsigned>((nv + kT * 4 - 1) / (kT * 4));
    const unsigned enc8 = static_cast<unsigned>((nv + kT * 8 - 1) / (kT * 8));
    std::vector<V> vs = {
        {"cur", per_tensor(tensor_amax<4, false>, tensor_encode<kFp8Div, 4>, occupancy_grid(tensor_amax<4, false>), enc4)},
        {"amax_u8", per_tensor(tensor_amax<8, false>, tensor_encode<kFp8Div, 4>, occupancy_grid(tensor_amax<8, false>), enc4)},
        {"evict_last", per_tensor(tensor_amax<4, true>, tensor_encode<kFp8Div, 4>, occupancy_grid(tensor_amax<4, true>), enc4)},
        {"evict_last_enc8", per_tensor(tensor_amax<4, true>, tensor_encode<kFp8Div, 8>, occupancy_grid(tensor_amax<4, true>), enc8)},
    };
    vs[0].launch(ref, ref_scale);
    CK(cudaDeviceSynchronize());
    for (auto& v : vs) {
      const double ms = time_ms([&] { v.launch(out, scale); });
      report("fp8_per_tensor", v.name, ms, moved, diff(n, 4));
    }
    // The fused kernel (one cooperative launch): its workspace, zeroed once; the kernel leaves it
    // zeroed. [0] amax, [2] blocks past the barrier, [3] blocks done.
    unsigned* ws = nullptr;
    CK(cudaMalloc(&ws, 32));
    CK(cudaMemset(ws, 0, 32));
    unsigned long long* times = nullptr;
    CK(cudaMalloc(&times, 3 * 8 * 1024));
    int sms = 0;
    CK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
    auto fused_v = [&](const char* scheme, const char* name, auto kernel, int threads, size_t smem) {
      CK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(smem)));
      int per = 0;
      CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per, kernel, threads, smem));
      if (per < 1) {
        std::fprintf(stderr, "%s: does not fit an SM\n", name);
        return;
      }
      auto launch = [&](uint8_t* o, float* s, unsigned long long* t) {
        const uint4* in_c = in;
        int64_t nv_c = nv;
        float* slot = reinterpret_cast<float*>(ws);
        unsigned* counter = ws + 2;
        void* args[] = {&in_c, &o, &nv_c, &slot, &counter, &s, &t};
        CK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(kernel), dim3(sms), dim3(threads), args, smem, 0));
      };
      const double ms = time_ms([&] { launch(out, scale, nullptr); });
      report(scheme, name, ms, moved, diff(n, 4));
      // Phase times of one more launch: start, after the grid barrier, end (ns, per block).
      launch(out, scale, times);
      std::vector<unsigned long long> t(3 * static_cast<size_t>(sms));
      CK(cudaMemcpy(t.data(), times, t.size() * 8, cudaMemcpyDeviceToHost));
      unsigned long long t0 = ~0ull, b0 = ~0ull, b1 = 0, e1 = 0;
      for (int i = 0; i < sms; ++i) {
        t0 = std::min(t0, t[3 * i]);
        b0 = std::min(b0, t[3 * i + 1]);
        b1 = std::max(b1, t[3 * i + 1]);
        e1 = std::max(e1, t[3 * i + 2]);
      }
      std::printf("{\"probe\":\"quant\",\"case\":\"%s\",\"variant\":\"%s\",\"phase1_us\":%.1f,"
                  "\"barrier_spread_us\":%.1f,\"phase2_us\":%.1f}\n",
                  scheme, name, (b0 - t0) / 1e3, (b1 - b0) / 1e3, (e1 - b1) / 1e3);
    };
    using namespace fused;
    constexpr size_t kRing = 7 * 2048 * 16;
    // Tie-heavy input (scale 1): the codes of every variant but "const" must equal cur's.
    fused_v("fp8_per_tensor", "fused_div", tensor_fused<512, 7, 2048, 1, 8, kEncDiv>, 512, kRing);
    fused_v("fp8_per_tensor", "fused_fma", tensor_fused<512, 7, 2048, 1, 8, kEncFma>, 512, kRing);
    fused_v("fp8_per_tensor", "fused_fma_16k_chunks", tensor_fused<512, 13, 1024, 1, 16, kEncFma>, 512, 13 * 1024 * 16);
    fused_v("fp8_per_tensor", "fused_fma_1024_threads", tensor_fused<1024, 7, 2048, 1, 8, kEncFma>, 1024, kRing);
    fused_v("fp8_per_tensor", "fused_fma_no_l2_hint", tensor_fused<512, 7, 2048, 0, 0, kEncFma>, 512, kRing);
    fused_v("fp8_per_tensor", "fused_const", tensor_fused<512, 7, 2048, 1, 8, kEncConst>, 512, kRing);
    {  // -0 and subnormals among the tie-heavy values
      std::vector<uint16_t> g = h_fp8;
      for (int64_t i = 1; i < n; i += 4099) g[i] = 0x8000;
      for (int64_t i = 3; i < n; i += 65537) g[i] = 0x0001 | static_cast<uint16_t>((i & 1) << 15);
      CK(cudaMemcpy(in, g.data(), in_bytes, cudaMemcpyHostToDevice));
      vs[0].launch(ref, ref_scale);
      CK(cudaDeviceSynchronize());
      fused_v("fp8_per_tensor_negzero_subnormal", "fused_fma", tensor_fused<512, 7, 2048, 1, 8, kEncFma>, 512, kRing);
    }
    {  // weights as a model has them (normal, no planted scale of 1: ties are rare)
      std::vector<uint16_t> g(n);
      std::mt19937_64 rng(43);
      std::normal_distribution<float> nd(0.0f, 0.02f);
      for (int64_t i = 0; i < n; ++i) g[i] = bf16(nd(rng));
      CK(cudaMemcpy(in, g.data(), in_bytes, cudaMemcpyHostToDevice));
      vs[0].launch(ref, ref_scale);
      CK(cudaDeviceSynchronize());
      report("fp8_per_tensor_normal", "cur", time_ms([&] { vs[0].launch(out, scale); }), moved, diff(n, 4));
      fused_v("fp8_per_tensor_normal", "fused_fma", tensor_fused<512, 7, 2048, 1, 8, kEncFma>, 512, kRing);
    }
    CK(cudaMemcpy(in, h_fp8.data(), in_bytes, cudaMemcpyHostToDevice));
    const unsigned ag = occupancy_grid(tensor_amax<4, false>);
    report("fp8_per_tensor", "amax_pass_only(read bytes)",
           time_ms([&] { tensor_amax<4, false><<<ag, kT>>>(in, nv, 0, scale); }), 2.0 * n, 0);
    report("fp8_per_tensor", "encode_pass_only(read+write bytes)",
           time_ms([&] { tensor_encode<kFp8Div, 4><<<enc4, kT>>>(in, out, nv, scale); }), 3.0 * n, 0);
  }

  // int4_group.
  {
    CK(cudaMemcpy(in, h_int4.data(), in_bytes, cudaMemcpyHostToDevice));
    const int64_t groups = n / 128;
    const double moved = 2.0 * n + 0.5 * n + 2.0 * groups;
    uint16_t* s16 = reinterpret_cast<uint16_t*>(scale);
    uint16_t* r16 = reinterpret_cast<uint16_t*>(ref_scale);
    const unsigned full = static_cast<unsigned>(groups * 8 / kT);
    int4_cur<<<full, kT>>>(in, reinterpret_cast<uint2*>(ref), r16, groups);
    CK(cudaDeviceSynchronize());
    auto run = [&](const char* name, auto f) {
      const double ms = time_ms(f);
      report("int4_group", name, ms, moved, diff(n / 2, groups * 2));
    };
    run("cur", [&] { int4_cur<<<full, kT>>>(in, reinterpret_cast<uint2*>(out), s16, groups); });
    run("new_u1_full", [&] { int4_new<1><<<full, kT>>>(in, reinterpret_cast<uint2*>(out), s16, groups); });
    run("new_u2", [&] { int4_new<2><<<full / 2, kT>>>(in, reinterpret_cast<uint2*>(out), s16, groups); });
    run("new_u4", [&] { int4_new<4><<<full / 4, kT>>>(in, reinterpret_cast<uint2*>(out), s16, groups); });
    run("new_u2_persistent", [&] {
      int4_new<2><<<occupancy_grid(int4_new<2>), kT>>>(in, reinterpret_cast<uint2*>(out), s16, groups);
    });
  }
  CK(cudaDeviceSynchronize());
  return 0;
}

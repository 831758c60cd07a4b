// Reference GEMMs against a float64 product of x and the dequantized weight. Tolerance: an f32 sum
// of K products may be off by K * 2^-23 * sum_k |x_k * w_k| (each product and each addition rounds
// once), which is what the tests allow.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>

#include "kernels/gemm.h"
#include "kernels/gptq.h"
#include "tests/kernels/gpu_util.h"
#include "tests/kernels/gptq_fixture.h"
#include "tests/kernels/test_util.h"

namespace ferry::kernels::testing {
namespace {

struct Weight {
  std::vector<HostTensor> t;
  std::vector<TensorView> v;
  std::vector<int64_t> shards;
  std::vector<double> logical;  // dequantized, [n][k]
};

HostTensor random_x(DType dt, int64_t m, int64_t k, uint64_t seed) {
  HostTensor x = empty_like(dt, {m, k});
  x.values.resize(static_cast<size_t>(m * k));
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  for (int64_t i = 0; i < m * k; ++i) x.values[static_cast<size_t>(i)] = store_value(x, i, d(rng));
  return x;
}

Weight quantized_weight(Scheme s, int64_t n, int64_t k, uint64_t seed) {
  Weight w;
  if (s == Scheme::kFp8PerTensor) w.shards = {n / 2, n - n / 2};
  HostTensor full = empty_like(DType::kF32, {n, k});
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 0.05f);
  for (int64_t i = 0; i < n * k; ++i) store_value(full, i, d(rng));
  auto layout = storage_layout(s, {n, k}, w.shards, DType::kBF16);
  EXPECT_TRUE(layout.ok());
  for (const auto& t : *layout) w.t.push_back(empty_like(t.dtype, t.shape));
  for (auto& t : w.t) w.v.push_back(t.view());
  EXPECT_TRUE(quantize(s, full.view(), w.shards, w.v).ok());
  HostTensor deq = empty_like(DType::kF32, {n, k});
  EXPECT_TRUE(dequantize(s, w.v, w.shards, deq.view()).ok());
  w.logical.resize(static_cast<size_t>(n * k));
  for (int64_t i = 0; i < n * k; ++i) {
    float f;
    std::memcpy(&f, &deq.bytes[static_cast<size_t>(i) * 4], 4);
    w.logical[static_cast<size_t>(i)] = f;
  }
  return w;
}

Weight gptq_weight(int64_t n, int64_t k, uint64_t seed) {
  Weight w;
  GptqCheckpoint c = make_gptq(n, k, seed);
  auto layout = gptq_storage_layout({n, k});
  EXPECT_TRUE(layout.ok());
  for (const auto& t : *layout) w.t.push_back(empty_like(t.dtype, t.shape));
  for (auto& t : w.t) w.v.push_back(t.view());
  EXPECT_TRUE(gptq_reload(c.qweight.view(), c.scales.view(), c.g_idx.view(), w.v).ok());
  w.logical = ref_gptq_weight(c);
  return w;
}

::testing::AssertionResult close_to_reference(const HostTensor& y, const HostTensor& x, const Weight& w, int64_t n,
                                              int64_t k) {
  const int64_t m = x.rows();
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double ref = 0, mag = 0;
      for (int64_t t = 0; t < k; ++t) {
        const double p = static_cast<double>(x.values[static_cast<size_t>(i * k + t)]) * w.logical[static_cast<size_t>(j * k + t)];
        ref += p;
        mag += std::fabs(p);
      }
      float got;
      std::memcpy(&got, &y.bytes[static_cast<size_t>(i * n + j) * 4], 4);
      const double tol = static_cast<double>(k) * std::ldexp(1.0, -23) * mag + 1e-30;
      if (!(std::fabs(got - ref) <= tol)) {
        return ::testing::AssertionFailure() << "y[" << i << "," << j << "] = " << got << ", reference " << ref
                                             << ", tolerance " << tol;
      }
    }
  }
  return ::testing::AssertionSuccess();
}

constexpr Scheme kOnline[] = {Scheme::kNone, Scheme::kFp8PerTensor, Scheme::kFp8PerChannel,
                              Scheme::kFp8Block, Scheme::kInt8PerChannel, Scheme::kInt4Group};

TEST(GemmTest, CpuMatchesFloat64Reference) {
  const int64_t n = 150, k = 384, m = 5;
  for (Scheme s : kAllSchemes) {
    for (DType xd : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string(scheme_name(s)) + " x " + std::string(dtype_name(xd)));
      Weight w = s == Scheme::kGptqInt4 ? gptq_weight(n, k, 3) : quantized_weight(s, n, k, 3);
      HostTensor x = random_x(xd, m, k, 4);
      HostTensor y = empty_like(DType::kF32, {m, n});
      Status st = gemm(s, x.view(), w.v, w.shards, y.view(), Exec{nullptr, 3});
      ASSERT_TRUE(st.ok()) << st.to_string();
      EXPECT_TRUE(close_to_reference(y, x, w, n, k));
    }
  }
}

// The act-order permutation matters: a GEMM that ignored perm would multiply x by the weight's rows
// in sorted order and miss the reference.
TEST(GemmTest, GptqIgnoringPermutationWouldFail) {
  const int64_t n = 64, k = 256;
  Weight w = gptq_weight(n, k, 9);
  HostTensor x = random_x(DType::kF32, 2, k, 10);
  HostTensor y = empty_like(DType::kF32, {2, n});
  ASSERT_TRUE(gemm(Scheme::kGptqInt4, x.view(), w.v, {}, y.view()).ok());
  EXPECT_TRUE(close_to_reference(y, x, w, n, k));
  std::vector<int32_t> identity(static_cast<size_t>(k));
  for (int64_t i = 0; i < k; ++i) identity[static_cast<size_t>(i)] = static_cast<int32_t>(i);
  std::memcpy(w.t[2].bytes.data(), identity.data(), identity.size() * 4);
  ASSERT_TRUE(gemm(Scheme::kGptqInt4, x.view(), w.v, {}, y.view()).ok());
  EXPECT_FALSE(close_to_reference(y, x, w, n, k));
}

TEST(GemmTest, BadShapesAreRefused) {
  Weight w = quantized_weight(Scheme::kInt8PerChannel, 8, 128, 1);
  HostTensor x = random_x(DType::kF32, 2, 64, 1);  // K mismatch
  HostTensor y = empty_like(DType::kF32, {2, 8});
  Status st = gemm(Scheme::kInt8PerChannel, x.view(), w.v, {}, y.view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  HostTensor xh = empty_like(DType::kF16, {2, 128});
  st = gemm(Scheme::kInt8PerChannel, xh.view(), w.v, {}, y.view());
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("f32 or bf16"), std::string::npos) << st.message();
}

TEST(GemmTest, CudaMatchesFloat64Reference) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t n = 200, k = 640, m = 3;
  for (Scheme s : kAllSchemes) {
    for (DType xd : {DType::kF32, DType::kBF16}) {
      SCOPED_TRACE(std::string(scheme_name(s)) + " x " + std::string(dtype_name(xd)));
      Weight w = s == Scheme::kGptqInt4 ? gptq_weight(n, k, 5) : quantized_weight(s, n, k, 5);
      HostTensor x = random_x(xd, m, k, 6);
      std::vector<DeviceTensor> dw;
      std::vector<TensorView> dv;
      for (auto& t : w.t) {
        dw.push_back(to_device(t.bytes, t.dtype, t.shape));
        dv.push_back(dw.back().view);
      }
      DeviceTensor dx = to_device(x.bytes, x.dtype, x.shape);
      DeviceTensor dy = device_output(DType::kF32, {m, n});  // garbage: the GEMM overwrites y
      Status st = gemm(s, dx.view, dv, w.shards, dy.view);
      ASSERT_TRUE(st.ok()) << st.to_string();
      HostTensor y = empty_like(DType::kF32, {m, n});
      y.bytes = to_host(dy.view);
      EXPECT_TRUE(close_to_reference(y, x, w, n, k));
    }
  }
}

// A workspace left non-zero makes the K-slices of the CUDA gptq GEMM run out of turn: the call
// reports it, and a zeroed workspace gives the right answer again.
TEST(GemmTest, CudaGptqStaleWorkspaceIsDetected) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t n = 130, k = 512, m = 2;
  Weight w = gptq_weight(n, k, 21);
  HostTensor x = random_x(DType::kF32, m, k, 22);
  std::vector<DeviceTensor> dw;
  std::vector<TensorView> dv;
  for (auto& t : w.t) {
    dw.push_back(to_device(t.bytes, t.dtype, t.shape));
    dv.push_back(dw.back().view);
  }
  DeviceTensor dx = to_device(x.bytes, x.dtype, x.shape);
  DeviceTensor dy = device_output(DType::kF32, {m, n});  // garbage: the GEMM overwrites y
  ASSERT_TRUE(gemm(Scheme::kGptqInt4, dx.view, dv, {}, dy.view).ok());
  HostTensor y = empty_like(DType::kF32, {m, n});
  y.bytes = to_host(dy.view);
  EXPECT_TRUE(close_to_reference(y, x, w, n, k));
  // Twice in a row works: the last slice leaves every counter at zero.
  ASSERT_TRUE(gemm(Scheme::kGptqInt4, dx.view, dv, {}, dy.view).ok());
  EXPECT_EQ(to_host(dv[3]), std::vector<uint8_t>(dv[3].nbytes(), 0));

  std::vector<uint8_t> stale(dv[3].nbytes(), 0);
  stale[0] = 2;  // tile 0's counter says slice 2 is next
  DeviceTensor dws = to_device(stale, DType::kI32, dv[3].shape());
  dv[3] = dws.view;
  Status st = gemm(Scheme::kGptqInt4, dx.view, dv, {}, dy.view);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition) << st.to_string();
  y.bytes = to_host(dy.view);
  EXPECT_FALSE(close_to_reference(y, x, w, n, k));
}

// gemm_async on the CPU runs to completion and gives gemm's bytes; gemm_check has nothing to find.
TEST(GemmTest, CpuAsyncIsGemm) {
  const int64_t n = 70, k = 256, m = 3;
  for (Scheme s : {Scheme::kFp8PerChannel, Scheme::kGptqInt4}) {
    Weight w = s == Scheme::kGptqInt4 ? gptq_weight(n, k, 31) : quantized_weight(s, n, k, 31);
    HostTensor x = random_x(DType::kBF16, m, k, 32);
    HostTensor y1 = empty_like(DType::kF32, {m, n}), y2 = empty_like(DType::kF32, {m, n});
    ASSERT_TRUE(gemm(s, x.view(), w.v, w.shards, y1.view()).ok());
    ASSERT_TRUE(gemm_async(s, x.view(), w.v, w.shards, y2.view()).ok());
    EXPECT_TRUE(gemm_check(s, w.v).ok());
    EXPECT_EQ(y1.bytes, y2.bytes);
  }
}

TEST(GemmTest, CheckRefusesAWorkspaceWithoutItsFlag) {
  Weight w = gptq_weight(70, 256, 33);
  std::vector<TensorView> v = w.v;
  std::vector<int32_t> one(1, 0);
  v[3] = TensorView(one.data(), DType::kI32, {1});
  EXPECT_EQ(gemm_check(Scheme::kGptqInt4, v).code(), StatusCode::kInvalidArgument);
}

#if defined(FERRY_HAVE_CUDA)
// The decode step's GEMMs captured into a real CUDA graph: gemm_async enqueues without waiting or
// copying, the graph replays with the live workspace, and gemm_check afterwards sees a clean
// workspace; a stale workspace under the same graph is reported by gemm_check.
TEST(GemmTest, CudaAsyncCapturesIntoAGraph) {
  FERRY_SKIP_WITHOUT_GPU();
  const int64_t n = 130, k = 512, m = 2;
  cudaStream_t stream = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking), cudaSuccess);
  const Exec exec{stream, 0};
  for (Scheme s : {Scheme::kGptqInt4, Scheme::kInt8PerChannel, Scheme::kFp8PerTensor}) {
    SCOPED_TRACE(std::string(scheme_name(s)));
    Weight w = s == Scheme::kGptqInt4 ? gptq_weight(n, k, 41) : quantized_weight(s, n, k, 41);
    HostTensor x = random_x(DType::kBF16, m, k, 42);
    std::vector<DeviceTensor> dw;
    std::vector<TensorView> dv;
    for (auto& t : w.t) {
      dw.push_back(to_device(t.bytes, t.dtype, t.shape));
      dv.push_back(dw.back().view);
    }
    DeviceTensor dx = to_device(x.bytes, x.dtype, x.shape);
    DeviceTensor dy = device_output(DType::kF32, {m, n});  // garbage: the GEMM overwrites y
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal), cudaSuccess);
    Status st = gemm_async(s, dx.view, dv, w.shards, dy.view, exec);
    ASSERT_EQ(cudaStreamEndCapture(stream, &graph), cudaSuccess);
    ASSERT_TRUE(st.ok()) << st.to_string();
    cudaGraphExec_t program = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&program, graph, 0), cudaSuccess);
    for (int replay = 0; replay < 3; ++replay) {
      ASSERT_EQ(cudaGraphLaunch(program, stream), cudaSuccess);
      st = gemm_check(s, dv, exec);
      ASSERT_TRUE(st.ok()) << st.to_string();
      HostTensor y = empty_like(DType::kF32, {m, n});
      y.bytes = to_host(dy.view);
      EXPECT_TRUE(close_to_reference(y, x, w, n, k)) << "replay " << replay;
    }
    if (s == Scheme::kGptqInt4) {
      EXPECT_EQ(to_host(dv[3]), std::vector<uint8_t>(dv[3].nbytes(), 0));
      // Poison tile 0's counter in the registered workspace the graph reads.
      const int32_t two = 2;
      ASSERT_EQ(cudaMemcpy(dv[3].data(), &two, sizeof(two), cudaMemcpyHostToDevice), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(program, stream), cudaSuccess);
      EXPECT_EQ(gemm_check(s, dv, exec).code(), StatusCode::kFailedPrecondition);
      // Sticky until the workspace is zeroed again.
      ASSERT_EQ(cudaMemset(dv[3].data(), 0, dv[3].nbytes()), cudaSuccess);
      ASSERT_EQ(cudaGraphLaunch(program, stream), cudaSuccess);
      EXPECT_TRUE(gemm_check(s, dv, exec).ok());
    }
    ASSERT_EQ(cudaGraphExecDestroy(program), cudaSuccess);
    ASSERT_EQ(cudaGraphDestroy(graph), cudaSuccess);
  }
  ASSERT_EQ(cudaStreamDestroy(stream), cudaSuccess);
}
#endif

}  // namespace
}  // namespace ferry::kernels::testing

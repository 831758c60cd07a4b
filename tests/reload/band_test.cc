// Bands of stacked matrices: a trainer holding a tensor per expert sends each expert's gate and up
// rows of a fused w13 [experts, 2I, H] as pieces of one matrix each. Kept (lent, borrowed) bands
// are processed at completion straight from the caller's bytes, without staging; whatever the mix
// of bands, copies and borrows that ended, the storage equals one quantization of the whole
// stacked tensor, under every online scheme and engine layout, on the host and on a CUDA device.
#include <cmath>
#include <random>

#include <fmt/format.h>

#include "core/float_convert.h"
#include "kernels/quantize.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

#define EXPECT_OK(expr)                       \
  do {                                        \
    const ::ferry::Status st_ = (expr);       \
    EXPECT_TRUE(st_.ok()) << st_.to_string(); \
  } while (0)

constexpr int64_t kExperts = 3, kCols = 256;
const char* kParam = "model.layers.0.mlp.experts.w13_weight";

// One parameter, w13 [experts, 2I, H], from per-expert gate and up tensors [I, H].
sharding::RankSpec stacked_spec(Scheme scheme, int64_t inter, EngineLayout layout) {
  sharding::RankSpec s;
  s.layout = layout;
  sharding::ParamSpec p{kParam, "model.layers.0", {kExperts, 2 * inter, kCols}, DType::kBF16, scheme, {inter, inter}, {}};
  for (int64_t e = 0; e < kExperts; ++e) {
    for (int k = 0; k < 2; ++k) {
      const std::string name = fmt::format("e{}.{}", e, k == 0 ? "gate" : "up");
      s.expects.push_back({name, DType::kBF16, {inter, kCols}});
      p.slices.push_back({name, Region{{0, 0}, {inter, kCols}}, Dims{e, k * inter, 0}});
    }
  }
  s.params.push_back(std::move(p));
  return s;
}

// The stacked tensor's bf16 values: a spread of magnitudes per row, and a few zero rows.
std::vector<uint16_t> stacked_values(int64_t inter, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.f, 1.f);
  const int64_t rows = kExperts * 2 * inter;
  std::vector<uint16_t> v(static_cast<size_t>(rows * kCols));
  for (int64_t r = 0; r < rows; ++r) {
    const float mag = r % 17 == 5 ? 0.f : std::ldexp(1.f, static_cast<int>(r % 9) - 4);
    for (int64_t c = 0; c < kCols; ++c) v[static_cast<size_t>(r * kCols + c)] = f32_to_bf16(mag * n(rng));
  }
  return v;
}

// How each band arrives.
enum class Intake { kLend, kBorrowThenRelease, kCopyGateLendUp, kLendGateCopyUp };

struct Case {
  Scheme scheme;
  EngineLayout layout;
  int64_t inter;
  Intake intake;
  Device device;
};

std::string describe(const Case& c) {
  return fmt::format("{} {} I={} intake {} on {}", scheme_name(c.scheme), engine_layout_name(c.layout), c.inter,
                     static_cast<int>(c.intake), c.device.to_string());
}

std::vector<uint8_t> host_bytes(const TensorView& v) {
  std::vector<uint8_t> out(v.nbytes());
  EXPECT_TRUE(copy_bytes(out.data(), Device::cpu(), v.data(), v.device(), out.size()).ok());
  return out;
}

// The reference: the whole stacked tensor quantized in one call on the host.
Result<std::map<std::string, std::vector<uint8_t>>> reference(const Case& c, const sharding::RankSpec& spec,
                                                             const std::vector<uint16_t>& values) {
  FERRY_ASSIGN_OR_RETURN(ModelStorage storage, ModelStorage::allocate(spec, Device::cpu()));
  const sharding::ParamSpec& p = spec.params[0];
  const TensorView input(const_cast<uint16_t*>(values.data()), DType::kBF16, p.shape);
  std::vector<TensorView> out;
  FERRY_ASSIGN_OR_RETURN(auto layout, kernels::storage_layout(p.scheme, c.layout, p.shape, p.shard_rows));
  for (const auto& t : layout) {
    FERRY_ASSIGN_OR_RETURN(TensorView v, storage.get(storage_name(p.name, t.suffix)));
    out.push_back(v);
  }
  // vLLM's and SGLang's fp8_per_tensor keep one scale per expert over its merged matrix.
  const std::vector<int64_t> shards =
      c.layout != EngineLayout::kFerry && c.scheme == Scheme::kFp8PerTensor ? std::vector<int64_t>{} : p.shard_rows;
  FERRY_RETURN_IF_ERROR(kernels::quantize(p.scheme, c.layout, input, shards, out, kernels::Exec{}));
  return testing::contents(storage);
}

// False when the layout does not define this stacked storage (kernels::storage_layout refuses it:
// some fused-expert scales in the engines' layouts; per-shard fp8_per_tensor of experts).
bool run_case(const Case& c) {
  SCOPED_TRACE(describe(c));
  const sharding::RankSpec spec = stacked_spec(c.scheme, c.inter, c.layout);
  auto storage = ModelStorage::allocate(spec, c.device);
  if (!storage.ok()) return false;
  const std::vector<uint16_t> values = stacked_values(c.inter, 11);
  auto want = reference(c, spec, values);
  EXPECT_TRUE(want.ok()) << want.status().to_string();
  auto engine = ReloadEngine::create(spec, *storage);
  EXPECT_TRUE(engine.ok()) << engine.status().to_string();
  if (!want.ok() || !engine.ok()) return true;
  ReloadEngine& e = **engine;
  // The trainer's per-expert tensors, where the pieces are read from (device memory for a device).
  const size_t band_bytes = static_cast<size_t>(c.inter * kCols) * 2;
  auto source = Buffer::allocate(values.size() * 2, c.device);
  EXPECT_TRUE(source.ok());
  if (!source.ok()) return true;
  EXPECT_TRUE(copy_bytes(source->data(), c.device, values.data(), Device::cpu(), values.size() * 2).ok());
  auto band = [&](int64_t ex, int k) {
    return static_cast<const char*>(source->data()) + static_cast<size_t>(ex * 2 + k) * band_bytes;
  };
  auto region = [&](int64_t ex, int k) { return Region{{ex, k * c.inter, 0}, {1, c.inter, kCols}}; };
  // Host copies for the copied and borrowed intakes (those take host bytes).
  const auto* host = reinterpret_cast<const char*>(values.data());
  auto host_band = [&](int64_t ex, int k) { return host + static_cast<size_t>(ex * 2 + k) * band_bytes; };

  EXPECT_OK(e.begin(1));
  size_t lent = 0;
  for (int64_t ex = 0; ex < kExperts; ++ex) {
    for (int k = 0; k < 2; ++k) {
      const bool lend = c.intake == Intake::kLend || (c.intake == Intake::kCopyGateLendUp && k == 1) ||
                        (c.intake == Intake::kLendGateCopyUp && k == 0);
      if (lend) {
        EXPECT_OK(e.lend_piece(0, 0, region(ex, k), DType::kBF16, nullptr, band(ex, k), band_bytes, c.device));
        ++lent;
      } else if (c.intake == Intake::kBorrowThenRelease) {
        // The gate is borrowed and its borrow ends (it is then copied) before the up arrives.
        EXPECT_OK(e.borrow_piece(0, 0, region(ex, k), DType::kBF16, host_band(ex, k), band_bytes));
        if (k == 0) EXPECT_OK(e.release_borrowed());
      } else {
        EXPECT_OK(e.apply_input_piece(0, 0, region(ex, k), DType::kBF16, host_band(ex, k), band_bytes));
      }
    }
  }
  auto report = e.finalize();
  EXPECT_TRUE(report.ok()) << report.status().to_string();
  if (!report.ok()) return true;
  EXPECT_EQ(report->census.moved, 0u);
  // Every lent band the kernel takes on its own is read in place: none of them is staged.
  const bool bands = c.scheme != Scheme::kFp8PerTensor && (c.scheme != Scheme::kFp8Block || c.inter % 128 == 0);
  if (c.intake == Intake::kLend && bands) {
    EXPECT_EQ(report->direct_pieces, lent);
    EXPECT_EQ(report->staged_on_device_pieces + report->device_staged_pieces, 0u);
  }
  std::map<std::string, std::vector<uint8_t>> got;
  for (const auto& [name, v] : storage->tensors()) got[name] = host_bytes(v);
  EXPECT_EQ(got.size(), want->size());
  for (const auto& [name, bytes] : *want) {
    EXPECT_TRUE(got.contains(name) && got.at(name) == bytes) << name << " differs from the whole tensor quantized at once";
  }
  return true;
}

std::vector<Device> devices() {
  std::vector<Device> out{Device::cpu()};
  if (cuda_device_available()) out.push_back(Device::cuda(0));
  return out;
}

TEST(Bands, PerExpertPiecesEqualTheStackedTensorQuantizedAtOnce) {
  int ran = 0, ferry_ran = 0, marlin_ran = 0;
  for (const Device device : devices()) {
    for (Scheme scheme : {Scheme::kNone, Scheme::kFp8PerChannel, Scheme::kFp8Block, Scheme::kInt8PerChannel,
                          Scheme::kInt4Group, Scheme::kFp8PerTensor}) {
      for (EngineLayout layout : {EngineLayout::kFerry, EngineLayout::kVllm, EngineLayout::kSglang}) {
        for (int64_t inter : {int64_t{128}, int64_t{192}}) {
          for (Intake intake : {Intake::kLend, Intake::kBorrowThenRelease, Intake::kCopyGateLendUp, Intake::kLendGateCopyUp}) {
            const bool done = run_case({scheme, layout, inter, intake, device});
            ran += done ? 1 : 0;
            if (scheme == Scheme::kInt4Group && layout != EngineLayout::kFerry) marlin_ran += done ? 1 : 0;
            // ferry's own layout defines every stacked scheme but per-shard fp8_per_tensor.
            if (layout == EngineLayout::kFerry && scheme != Scheme::kFp8PerTensor) {
              EXPECT_TRUE(done) << scheme_name(scheme);
              ferry_ran += done ? 1 : 0;
            }
          }
        }
      }
    }
  }
  EXPECT_GE(ferry_ran, 40);  // 5 schemes x 2 sizes x 4 intakes on the host
  EXPECT_GE(ran, 60);
  EXPECT_GE(marlin_ran, 16);  // int4 in Marlin's layout: 2 engines x 2 sizes x 4 intakes on the host
}

// Which bands the kernel takes alone: under fp8_block only whole 128-row blocks (or the rows to a
// matrix's end), one matrix, every column; never under fp8_per_tensor. (The test above checks that
// the others, staged, still give the whole matrix: I = 192.)
TEST(Bands, OnlyWholeBlocksAreBandsUnderFp8Block) {
  const sharding::RankSpec spec = stacked_spec(Scheme::kFp8Block, 192, EngineLayout::kFerry);
  auto kernel = scheme_kernel(spec.params[0]);
  ASSERT_TRUE(kernel.ok());
  EXPECT_TRUE((*kernel)->can_process_band(Region{{1, 0, 0}, {1, 128, kCols}}));
  EXPECT_TRUE((*kernel)->can_process_band(Region{{1, 256, 0}, {1, 128, kCols}}));  // reaches the end (384)
  EXPECT_FALSE((*kernel)->can_process_band(Region{{1, 0, 0}, {1, 192, kCols}}));
  EXPECT_FALSE((*kernel)->can_process_band(Region{{1, 192, 0}, {1, 192, kCols}}));
  EXPECT_FALSE((*kernel)->can_process_band(Region{{1, 0, 0}, {1, 128, 128}}));  // half the columns
  EXPECT_FALSE((*kernel)->can_process_band(Region{{0, 0, 0}, {2, 128, kCols}}));  // two matrices
  const sharding::RankSpec pt = stacked_spec(Scheme::kFp8PerTensor, 128, EngineLayout::kFerry);
  EXPECT_FALSE((*scheme_kernel(pt.params[0]))->can_process_band(Region{{1, 0, 0}, {1, 128, kCols}}));
  const sharding::RankSpec pc = stacked_spec(Scheme::kFp8PerChannel, 192, EngineLayout::kFerry);
  EXPECT_TRUE((*scheme_kernel(pc.params[0]))->can_process_band(Region{{1, 5, 0}, {1, 7, kCols}}));
}

}  // namespace
}  // namespace ferry::reload

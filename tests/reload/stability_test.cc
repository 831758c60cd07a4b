// Parametrized over every scheme and several piece shapes: process twice with the copy-in between
// and assert that no registered tensor moved, and that storage holds exactly what the scheme's
// kernel makes of the whole parameter (assembled here, independently of the engine's staging).
#include <cstring>

#include <fmt/format.h>

#include "kernels/gptq.h"
#include "reload/checkpoint_loader.h"
#include "tests/reload/util.h"

namespace ferry::reload {
namespace {

using testing::make_rank;

struct Case {
  Scheme scheme;
  LoadOptions load;
  std::string label;
  int64_t vocab = 0;  // non-zero: a vocabulary the spec pads (rows no slice covers, zeros to the kernel)
};

class StabilityTest : public ::testing::TestWithParam<Case> {};

// The full-precision parameter, built element by element from its slices (2-byte dtypes).
std::vector<uint16_t> assemble(const sharding::ParamSpec& p, const Checkpoint& ckpt) {
  std::vector<uint16_t> out(static_cast<size_t>(shape_numel(p.shape)), 0);
  const int64_t cols = p.shape.size() > 1 ? p.shape[1] : 1;
  for (const auto& s : p.slices) {
    const TensorView& src = ckpt.at(s.source);
    const int64_t scols = src.rank() > 1 ? src.dim(1) : 1;
    const int64_t rows = s.src.size[0], n = s.src.size.size() > 1 ? s.src.size[1] : 1;
    const int64_t sc0 = s.src.offset.size() > 1 ? s.src.offset[1] : 0;
    const int64_t dc0 = s.dst_offset.size() > 1 ? s.dst_offset[1] : 0;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < n; ++c) {
        out[static_cast<size_t>((s.dst_offset[0] + r) * cols + dc0 + c)] =
            src.data_as<uint16_t>()[(s.src.offset[0] + r) * scols + sc0 + c];
      }
    }
  }
  return out;
}

TEST_P(StabilityTest, ProcessTwiceNothingMovesAndStorageMatchesTheKernel) {
  const Case& c = GetParam();
  tiny::Config cfg;
  if (c.vocab) cfg.vocab = c.vocab;
  auto rank = make_rank(cfg, c.scheme);
  auto a = tiny::Weights::random(cfg, rank->spec, 11);
  auto b = tiny::Weights::random(cfg, rank->spec, 12);
  ASSERT_TRUE(a.ok() && b.ok());
  const auto before = testing::identities(rank->storage);

  auto ra = load_checkpoint(*rank->engine, a->checkpoint(), 1, c.load);
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  EXPECT_EQ(testing::identities(rank->storage), before);
  auto rb = load_checkpoint(*rank->engine, b->checkpoint(), 2, c.load);
  ASSERT_TRUE(rb.ok()) << rb.status().to_string();
  EXPECT_EQ(testing::identities(rank->storage), before);
  EXPECT_EQ(rb->census.moved, 0u);
  EXPECT_EQ(rb->census.registered, rank->engine->registry().size());
  EXPECT_EQ(rb->census.registered, before.size());
  EXPECT_EQ(rb->layers, rank->engine->layer_count());
  for (const auto& t : rank->engine->registry().tensors()) {
    EXPECT_EQ(t.view.data(), before.at(t.name).first) << t.name;
  }

  for (const auto& p : rank->spec.params) {
    const Scheme scheme = p.scheme;
    auto layout = param_layout(p, DType::kBF16);
    ASSERT_TRUE(layout.ok());
    std::vector<Buffer> bufs;
    std::vector<TensorView> ref;
    for (const auto& t : *layout) {
      auto buf = Buffer::allocate(dtype_bytes(t.dtype, shape_numel(t.shape)));
      ASSERT_TRUE(buf.ok());
      ref.push_back(*buf->view(t.dtype, t.shape));
      bufs.push_back(std::move(*buf));
    }
    if (scheme == Scheme::kGptqInt4) {
      const auto& ck = b->checkpoint();
      ASSERT_OK(kernels::gptq_reload(ck.at(storage_name(p.name, "qweight")), ck.at(storage_name(p.name, "scales")),
                                     ck.at(storage_name(p.name, "g_idx")), ref));
    } else {
      auto full = assemble(p, b->checkpoint());
      TensorView in(full.data(), p.source_dtype, p.shape);
      ASSERT_OK(kernels::quantize(scheme, in, p.shard_rows, ref));
    }
    for (size_t i = 0; i < layout->size(); ++i) {
      const std::string name = storage_name(p.name, (*layout)[i].suffix);
      EXPECT_EQ(testing::bytes_of(rank->storage.tensors().at(name)), testing::bytes_of(ref[i])) << name;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (const Scheme s : kAllSchemes) {
    out.push_back({s, {}, "whole"});
    LoadOptions chunk16;
    chunk16.chunk_rows = 16;
    out.push_back({s, chunk16, "rows16"});
    LoadOptions chunk128;
    chunk128.chunk_rows = 128;
    chunk128.shuffle_seed = 7;
    out.push_back({s, chunk128, "rows128_shuffled"});
    // 1000 rows padded to 1024: padding is zeroed, in staging or on its own, whichever way the
    // pieces arrive; the second update reuses the first one's pooled buffers.
    out.push_back({s, {}, "padded_whole", 1000});
    LoadOptions lent;
    lent.lend = true;
    out.push_back({s, lent, "padded_whole_lent", 1000});
    LoadOptions lent_rows;
    lent_rows.lend = true;
    lent_rows.chunk_rows = 96;
    lent_rows.shuffle_seed = 5;
    out.push_back({s, lent_rows, "padded_rows96_shuffled_lent", 1000});
    // Borrowed from buckets that are spoiled once released: layers a bucket completes are
    // processed from it; the rest must have been copied by release_borrowed().
    LoadOptions borrowed_rows;
    borrowed_rows.borrow_bucket_bytes = 40 << 10;
    borrowed_rows.chunk_rows = 16;
    out.push_back({s, borrowed_rows, "rows16_borrowed40k"});
    LoadOptions borrowed_padded;
    borrowed_padded.borrow_bucket_bytes = 100 << 10;
    borrowed_padded.chunk_rows = 96;
    borrowed_padded.shuffle_seed = 3;
    out.push_back({s, borrowed_padded, "padded_rows96_shuffled_borrowed100k", 1000});
    LoadOptions borrowed_whole;
    borrowed_whole.borrow_bucket_bytes = 4 << 20;
    out.push_back({s, borrowed_whole, "whole_borrowed4m"});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(EveryScheme, StabilityTest, ::testing::ValuesIn(cases()),
                         [](const auto& info) {
                           return std::string(scheme_name(info.param.scheme)) + "_" + info.param.label;
                         });

// Piece by piece: whole-row pieces of per-channel schemes never stage the full-precision layer.
TEST(Piecewise, PerChannelPiecesStageOnlyQuantizedScratch) {
  const tiny::Config cfg;
  auto fp = make_rank(cfg, Scheme::kFp8PerTensor);
  auto pc = make_rank(cfg, Scheme::kFp8PerChannel);
  auto w = tiny::Weights::random(cfg, fp->spec, 3);
  ASSERT_TRUE(w.ok());
  LoadOptions o;
  o.chunk_rows = 8;
  auto r1 = load_checkpoint(*fp->engine, w->checkpoint(), 1, o);
  auto r2 = load_checkpoint(*pc->engine, w->checkpoint(), 1, o);
  ASSERT_TRUE(r1.ok() && r2.ok());
  EXPECT_GT(r2->piecewise_pieces, 0u);
  // A decoder layer in bf16 is 2 bytes per element; its fp8 scratch about 1.
  EXPECT_LT(r2->peak_staging_bytes * 10, r1->peak_staging_bytes * 6);
}

// fp8_block: a vocabulary shard of 1000 rows padded to 1024 ends inside its last 128-row band. Its
// first 896 rows are whole bands and are processed straight from the lent piece; only the rest of
// the piece waits in staging beside the padding. As many pieces are processed in place as when the
// vocabulary fills its bands.
TEST(Piecewise, WholeBandsOfAPaddedShardAreNotStaged) {
  LoadOptions lent;
  lent.lend = true;
  std::map<int64_t, uint64_t> direct;
  for (const int64_t vocab : {1000, 1024}) {
    tiny::Config cfg;
    cfg.vocab = vocab;
    auto rank = make_rank(cfg, Scheme::kFp8Block);
    auto w = tiny::Weights::random(cfg, rank->spec, 5);
    ASSERT_TRUE(w.ok());
    auto r = load_checkpoint(*rank->engine, w->checkpoint(), 1, lent);
    ASSERT_TRUE(r.ok()) << r.status().to_string();
    direct[vocab] = r->direct_pieces;
  }
  EXPECT_GT(direct[1024], 0u);
  EXPECT_EQ(direct[1000], direct[1024]);
}

}  // namespace
}  // namespace ferry::reload

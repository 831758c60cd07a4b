// LocalHoldings: what a trainer rank's send(name, tensor) sends, and the errors that name what the
// user wrote (checkpoint names, local tensor names, the box and the shape).
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "coordinator/local_holdings.h"
#include "sharding/llama.h"
#include "tests/coordinator/cluster.h"

namespace ferry::coordinator {
namespace {

using ::testing::HasSubstr;

TEST(LocalHoldings, AFusedLocalTensorYieldsEachBoxAtItsRows) {
  const auto cfg = testutil::llama_config(128, 4, 2, 256, 300, 1);  // head_dim 32, 2 KV groups
  const auto manifest = sharding::llama_manifest(cfg);
  auto layout = sharding::megatron_layout(cfg, 1, 2);
  ASSERT_TRUE(layout.ok()) << layout.status().to_string();
  LocalHoldings h;
  ASSERT_TRUE(h.reset(manifest, {}, *layout, "trainer rank 1 of 2").ok());
  // Rank 1 holds KV group 1: 2 query heads, then its key and value head, 32 rows each.
  std::vector<uint16_t> qkv(128 * 128);
  auto parts = h.take("decoder.layers.0.self_attention.linear_qkv.weight", TensorView(qkv.data(), DType::kBF16, {128, 128}));
  ASSERT_TRUE(parts.ok()) << parts.status().to_string();
  ASSERT_EQ(parts->size(), 3u);
  EXPECT_EQ(manifest[(*parts)[0].source].name, "model.layers.0.self_attn.q_proj.weight");
  EXPECT_EQ((*parts)[0].box.to_string(), "[64:128, 0:128]");
  EXPECT_EQ((*parts)[0].view.data(), qkv.data());
  EXPECT_EQ((*parts)[1].box.to_string(), "[32:64, 0:128]");  // k_proj, KV head 1
  EXPECT_EQ((*parts)[1].view.data(), qkv.data() + 64 * 128);
  EXPECT_EQ((*parts)[2].view.data(), qkv.data() + 96 * 128);
  EXPECT_EQ((*parts)[2].view.shape(), (Shape{32, 128}));
  // Each local name once; the names still wanted come in plan order.
  auto again = h.take("decoder.layers.0.self_attention.linear_qkv.weight", TensorView(qkv.data(), DType::kBF16, {128, 128}));
  EXPECT_THAT(again.status().message(), HasSubstr("already sent"));
  std::vector<int> order(manifest.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = static_cast<int>(i);
  const auto wanted = h.wanted(order);
  EXPECT_EQ(wanted.front().get(), "embedding.word_embeddings.weight");
  EXPECT_EQ(
      std::count_if(wanted.begin(), wanted.end(),
                    [](const std::string& w) { return w == "decoder.layers.0.self_attention.linear_qkv.weight"; }),
      0);
}

// The next update's reset with the same manifest, holdings and layout keeps what was worked out and
// only forgets what was sent; other holdings, another layout or another manifest are worked out
// afresh (a name the old ones held is refused, the new ones' are taken).
TEST(LocalHoldings, ANewUpdateForgetsWhatWasSentAndFollowsChangedHoldings) {
  const auto cfg = testutil::llama_config(128, 4, 2, 256, 300, 1);
  const auto manifest = sharding::llama_manifest(cfg);
  LocalHoldings h;
  std::vector<uint16_t> buf(300 * 128);
  const std::string qkv = "decoder.layers.0.self_attention.linear_qkv.weight";
  const TensorView local(buf.data(), DType::kBF16, {128, 128});
  const auto layout = sharding::megatron_layout(cfg, 0, 2);
  ASSERT_TRUE(layout.ok());
  for (int update = 0; update < 2; ++update) {
    ASSERT_TRUE(h.reset(manifest, {}, *layout, "trainer rank 0 of 2").ok());
    EXPECT_TRUE(h.take(qkv, local).ok()) << "update " << update;
    EXPECT_FALSE(h.take(qkv, local).ok()) << "update " << update;
  }
  // Another rank's layout, the same names: its own boxes.
  const auto other = sharding::megatron_layout(cfg, 1, 2);
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(h.reset(manifest, {}, *layout, "trainer rank 0 of 2").ok());
  auto first = h.take(qkv, local);
  ASSERT_TRUE(first.ok());
  ASSERT_TRUE(h.reset(manifest, {}, *other, "trainer rank 1 of 2").ok());
  auto second = h.take(qkv, local);
  ASSERT_TRUE(second.ok());
  EXPECT_NE((*first)[0].box.to_string(), (*second)[0].box.to_string()) << "the first layout's boxes were kept";
  // Holdings of whole tensors instead: the layout's local names are gone, the checkpoint's are taken.
  const auto& embed = manifest[0];
  sharding::SenderInfo whole;
  whole.owns = {embed.name};
  ASSERT_TRUE(h.reset(manifest, whole, {}, "trainer rank 0 of 2").ok());
  EXPECT_THAT(h.take(qkv, local).status().message(), HasSubstr("not in this update's manifest"));
  EXPECT_TRUE(h.take(embed.name, TensorView(buf.data(), DType::kBF16, embed.shape)).ok());
  ASSERT_EQ(h.wanted({0}).size(), 0u);
  // A manifest without that tensor: refused where it was taken before, and the error says why.
  const sharding::Manifest rest(manifest.begin() + 1, manifest.end());
  EXPECT_THAT(h.reset(rest, whole, {}, "trainer rank 0 of 2").message(), HasSubstr("which is not in the manifest"));
  EXPECT_FALSE(h.take(embed.name, TensorView(buf.data(), DType::kBF16, embed.shape)).ok())
      << "holdings that failed to reset take nothing";
}

TEST(LocalHoldings, ErrorsNameTheLocalTensorTheBoxAndTheShape) {
  const auto cfg = testutil::llama_config(128, 4, 2, 256, 300, 1);
  const auto manifest = sharding::llama_manifest(cfg);
  LocalHoldings h;
  ASSERT_TRUE(h.reset(manifest, {}, *sharding::megatron_layout(cfg, 0, 2), "trainer rank 0 of 2").ok());
  std::vector<uint16_t> buf(256 * 128);
  auto short_fc1 = h.take("decoder.layers.0.mlp.linear_fc1.weight", TensorView(buf.data(), DType::kBF16, {200, 128}));
  EXPECT_THAT(short_fc1.status().message(), HasSubstr("shape [200, 128] cannot hold model.layers.0.mlp.up_proj.weight"));
  auto checkpoint_name = h.take("model.layers.0.self_attn.q_proj.weight", TensorView(buf.data(), DType::kBF16, {64, 128}));
  EXPECT_THAT(checkpoint_name.status().message(), HasSubstr("trainer rank 0 of 2 declared no part of it"));
  auto unknown = h.take("decoder.layers.9.mlp.linear_fc1.weight", TensorView(buf.data(), DType::kBF16, {256, 128}));
  EXPECT_THAT(unknown.status().message(), HasSubstr("not in this update's manifest"));
  // Holdings and a layout at once are refused.
  sharding::SenderInfo rows;
  rows.owns = {"lm_head.weight"};
  EXPECT_THAT(h.reset(manifest, rows, *sharding::megatron_layout(cfg, 0, 2), "trainer rank 0 of 2").message(),
              HasSubstr("both holdings and a source layout"));
}

}  // namespace
}  // namespace ferry::coordinator

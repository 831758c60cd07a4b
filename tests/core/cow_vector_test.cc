#include "core/cow_vector.h"

#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace ferry {
namespace {

using Names = CowVector<std::string>;

TEST(CowVector, CopiesShareOneBufferAndReadsKeepSharing) {
  Names a(std::vector<std::string>{"embed", "q_proj", "lm_head"});
  const Names b = a;
  EXPECT_TRUE(a.shares(b));
  EXPECT_EQ(a.identity(), b.identity());
  // Element access, iteration and the vector view read the one buffer.
  EXPECT_EQ(&a[1], &b[1]);
  std::string joined;
  for (const std::string& s : b) joined += s + ",";
  EXPECT_EQ(joined, "embed,q_proj,lm_head,");
  const std::vector<std::string>& view = b;
  EXPECT_EQ(&view, &a.get());
  EXPECT_EQ(b.size(), 3u);
  EXPECT_EQ(b.front(), "embed");
  EXPECT_EQ(b.back(), "lm_head");
  EXPECT_TRUE(a.shares(b));
}

TEST(CowVector, AWriteCopiesASharedBufferFirst) {
  Names a(std::vector<std::string>{"x", "y"});
  Names b = a;
  b.edit()[0] = "changed";
  EXPECT_FALSE(a.shares(b));
  EXPECT_EQ(a[0], "x");
  EXPECT_EQ(b[0], "changed");
  EXPECT_EQ(b[1], "y");

  Names c = a;
  c.push_back("z");
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(c.size(), 3u);
  Names d = a;
  d.emplace_back("w");
  EXPECT_EQ(a.size(), 2u);
  EXPECT_EQ(d.back(), "w");
}

TEST(CowVector, TheOnlyOwnerWritesInPlace) {
  Names a(std::vector<std::string>{"x"});
  const void* before = a.identity();
  a.edit()[0] = "y";
  a.push_back("z");
  EXPECT_EQ(a.identity(), before);
  {
    Names copy = a;
    (void)copy;
  }
  a.edit().push_back("after a copy died");
  EXPECT_EQ(a.identity(), before);
}

TEST(CowVector, EmptyMovedAndCleared) {
  Names never;
  EXPECT_TRUE(never.empty());
  EXPECT_EQ(never.identity(), nullptr);
  EXPECT_FALSE(never.shares(Names{}));  // two empty vectors share no buffer
  EXPECT_EQ(never.begin(), never.end());
  Names a(std::vector<std::string>{"x"});
  const void* id = a.identity();
  Names moved = std::move(a);
  EXPECT_EQ(moved.identity(), id);
  EXPECT_EQ(moved[0], "x");
  moved.clear();
  EXPECT_TRUE(moved.empty());
  EXPECT_EQ(moved, Names{});
}

TEST(CowVector, EqualByContentSharedOnlyWhenAsked) {
  Names a(std::vector<std::string>{"x", "y"});
  Names b(std::vector<std::string>{"x", "y"});
  Names c(std::vector<std::string>{"x", "z"});
  EXPECT_EQ(a, b);
  EXPECT_FALSE(a == c);
  EXPECT_EQ(a, (std::vector<std::string>{"x", "y"}));
  EXPECT_FALSE(a.shares(b));
  EXPECT_FALSE(c.share_if_equal(a));
  EXPECT_FALSE(c.shares(a));
  EXPECT_EQ(c[1], "z");
  EXPECT_TRUE(b.share_if_equal(a));
  EXPECT_TRUE(b.shares(a));
  EXPECT_TRUE(b.share_if_equal(a));  // already shared
  Names empty;
  EXPECT_FALSE(empty.share_if_equal(Names{}));
}

// Copies written from different threads each get their own buffer; the original stays as it was
// (run under TSan by scripts/tsan.sh).
TEST(CowVector, CopiesWrittenFromThreads) {
  const Names original(std::vector<std::string>(64, "v"));
  std::vector<Names> copies(4, original);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < copies.size(); ++t) {
    threads.emplace_back([&copies, &original, t] {
      for (int i = 0; i < 100; ++i) {
        Names mine = original;
        mine.edit()[static_cast<size_t>(i) % 64] = "t" + std::to_string(t);
        copies[t] = mine;
      }
    });
  }
  for (auto& th : threads) th.join();
  for (size_t t = 0; t < copies.size(); ++t) {
    EXPECT_EQ(copies[t][99 % 64], "t" + std::to_string(t));
    EXPECT_FALSE(copies[t].shares(original));
  }
  for (const std::string& s : original) EXPECT_EQ(s, "v");
}

}  // namespace
}  // namespace ferry

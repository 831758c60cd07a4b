// The three-process scenario of ferry-demo (trainer with the embedded coordinator, and a TP-2
// replica as two more processes) run as a black box: its output is what outside scripts parse.
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <gtest/gtest.h>

namespace {

struct DemoRun {
  int rc = -1;
  std::vector<std::string> lines;
};

DemoRun run(const std::string& args) {
  DemoRun r;
  FILE* p = popen((std::string(FERRY_DEMO_PATH) + " " + args + " 2>&1").c_str(), "r");
  if (!p) return r;
  char buf[4096];
  while (fgets(buf, sizeof buf, p)) {
    std::string s(buf);
    if (!s.empty() && s.back() == '\n') s.pop_back();
    r.lines.push_back(s);
  }
  const int status = pclose(p);
  r.rc = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

TEST(Demo, ThreeVerifiedUpdatesWithNothingMoved) {
  DemoRun r = run("--updates 3 --tp 2");
  ASSERT_EQ(r.rc, 0);
  int updates = 0;
  for (const auto& l : r.lines) {
    // update v3: ok ranks=2 bytes=123456 direct=0 seconds=0.0123 gbps=1.23 moved=0/42 verified
    unsigned v = 0, ranks = 0, moved = 1, registered = 0;
    unsigned long long bytes = 0, direct = 1;
    double seconds = 0, gbps = 0;
    char tail[32] = {};
    const int n = std::sscanf(l.c_str(), "update v%u: ok ranks=%u bytes=%llu direct=%llu seconds=%lf gbps=%lf moved=%u/%u %31s",
                              &v, &ranks, &bytes, &direct, &seconds, &gbps, &moved, &registered, tail);
    if (n != 9) continue;
    EXPECT_EQ(direct, 0u) << "host weights travel as bytes";
    ++updates;
    EXPECT_EQ(v, static_cast<unsigned>(updates));
    EXPECT_EQ(ranks, 2u);
    EXPECT_GT(bytes, 0u);
    EXPECT_EQ(moved, 0u);
    EXPECT_GT(registered, 0u);
    EXPECT_STREQ(tail, "verified");
  }
  EXPECT_EQ(updates, 3) << "output:\n" << [&] {
    std::string all;
    for (const auto& l : r.lines) all += l + "\n";
    return all;
  }();
}

TEST(Demo, DumpDirHoldsEveryRanksTensorsPerVersion) {
  char tmpl[] = "/tmp/ferry-demo-test-XXXXXX";
  ASSERT_NE(mkdtemp(tmpl), nullptr);
  const std::string dir = tmpl;
  DemoRun r = run("--updates 2 --tp 2 --dump-dir " + dir);
  ASSERT_EQ(r.rc, 0);
  for (int v = 1; v <= 2; ++v) {
    for (int rank = 0; rank < 2; ++rank) {
      const std::string f = dir + "/v" + std::to_string(v) + "/rank" + std::to_string(rank) + ".safetensors";
      FILE* fp = fopen(f.c_str(), "rb");
      ASSERT_NE(fp, nullptr) << f;
      unsigned char len[8];
      ASSERT_EQ(fread(len, 1, 8, fp), 8u);
      fclose(fp);
      EXPECT_GT(len[0] | len[1] << 8, 0);
    }
  }
  std::filesystem::remove_all(dir);
}

}  // namespace

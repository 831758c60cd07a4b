// UCX's own log records go through ferry's logger, never to stdout, where ferry's commands print
// their results (`ferry bench e2e --json` is read one line per result). UCX prints to stdout by
// default (UCX_LOG_FILE); a same-host close racing its peer's teardown logs an error there, which
// once broke the bench's output. Part of the conformance suite's binary; built only with ucx.
#include <fcntl.h>
#include <unistd.h>

#include <gtest/gtest.h>
#include <ucs/config/global_opts.h>
#include <ucs/debug/log_def.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "tests/common/warnings.h"
#include "tests/transport/conformance.h"

namespace ferry::transport::testing {
namespace {

// What `fn` writes to file descriptor 1.
template <typename Fn>
std::string stdout_of(Fn fn) {
  char path[] = "/tmp/ferry-ucx-log-XXXXXX";
  const int fd = mkstemp(path);
  if (fd < 0) return "(no temporary file)";
  unlink(path);
  std::fflush(stdout);
  const int saved = dup(1);
  dup2(fd, 1);
  fn();
  std::fflush(stdout);
  dup2(saved, 1);
  close(saved);
  std::string out;
  char buf[4096];
  lseek(fd, 0, SEEK_SET);
  for (ssize_t n; (n = read(fd, buf, sizeof buf)) > 0;) out.append(buf, static_cast<size_t>(n));
  close(fd);
  return out;
}

TEST(UcxLog, RecordsGoToFerrysLoggerNotStdout) {
  if (ucs_global_opts.log_file != nullptr && ucs_global_opts.log_file[0] != '\0') {
    GTEST_SKIP() << "UCX_LOG_FILE is set: UCX's output is the user's choice";
  }
  if (!ucs_log_is_enabled(UCS_LOG_LEVEL_WARN)) GTEST_SKIP() << "UCX_LOG_LEVEL is below warnings";
  auto tx = create_transport("ucx");  // the first ucx transport routes UCX's records
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  testutil::CaughtWarnings caught;
  const std::string out = stdout_of([] { ucs_warn("ucx-log-probe %d", 42); });
  EXPECT_EQ(out.find("ucx-log-probe"), std::string::npos) << "UCX printed to stdout:\n" << out;
  EXPECT_EQ(caught.count("ucx: ", "ucx-log-probe 42"), 1u);
  (*tx)->shutdown();
}

}  // namespace
}  // namespace ferry::transport::testing

// Data listeners outlive descriptor exhaustion: a burst of connections past RLIMIT_NOFILE makes
// accept() fail (EMFILE) at a receiver in a child process; once they close, a legitimate sender
// still gets its bucket through. Before, the tcp listener's accept loop ended at the first error.
#include <gtest/gtest.h>
#include <unistd.h>

#include <vector>

#include "tests/transport/harness.h"
#include "tests/transport/stranger.h"

namespace ferry::transport::testing {
namespace {

TEST(TcpAccept, ListenerSurvivesDescriptorExhaustion) {
  auto child = Child::spawn("fd_limited_receiver", "tcp", "");
  ASSERT_TRUE(child.ok()) << child.status().to_string();
  auto line = (*child)->read_line(in(30s));
  ASSERT_TRUE(line && line->starts_with("blob ")) << "the child did not report its blob";
  const std::string blob = line->substr(5);
  // Four times the child's spare descriptors: they wait in its backlog once it has none left.
  std::vector<int> burst;
  for (int i = 0; i < 32; ++i) {
    const int fd = raw_tcp_socket(blob);
    ASSERT_GE(fd, 0);
    burst.push_back(fd);
  }
  const auto said = (*child)->read_line(in(20s));
  EXPECT_EQ(said, std::optional<std::string>("accept_failed")) << "the child's accept never failed: the test proves nothing";
  for (int fd : burst) close(fd);

  auto tx = create_transport("tcp");
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  auto conn = (*tx)->connect(blob, in(10s), kCredential);
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  std::vector<uint8_t> bytes(4096, 7);
  auto region = (*tx)->register_memory(bytes.data(), bytes.size(), Device::cpu());
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  auto h = (*conn)->post(**region, 0, bytes.size());
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  EXPECT_TRUE((*h)->wait(in(10s)).ok());
  // The burst's connections are closed by now; the receiver reaches ours once it has taken them off
  // its backlog, which the admission deadline bounds for any it holds.
  EXPECT_EQ((*child)->read_line(in(kAdmissionDeadline + 20s)), std::optional<std::string>("bucket"))
      << "the listener stopped accepting after running out of descriptors";
  conn->reset();
  (*tx)->shutdown();
}

}  // namespace
}  // namespace ferry::transport::testing

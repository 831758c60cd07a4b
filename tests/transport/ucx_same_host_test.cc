// ucx between two processes of one host: the endpoints go over UCX's shared-memory transports and
// cma, not its tcp (ucx_transport.cc says how). Part of the conformance suite's binary; built only
// with ucx.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <string>
#include <vector>

#include "tests/transport/conformance.h"
#include "transport/ucx_transport.h"

namespace ferry::transport::testing {
namespace {

TEST(UcxSameHost, EndpointUsesSharedMemoryAndCma) {
  if (std::getenv("UCX_TLS") != nullptr) GTEST_SKIP() << "UCX_TLS is set: the transports are the user's choice";
  ScopedEnv tls("UCX_TLS", "sm,self,tcp");
  auto rx = create_transport("ucx");
  ASSERT_TRUE(rx.ok()) << rx.status().to_string();
  auto tx = create_transport("ucx");
  ASSERT_TRUE(tx.ok()) << tx.status().to_string();
  auto blob = (*rx)->listen([](const uint8_t*, size_t) { return ok_status(); }, [](const Status&) {});
  ASSERT_TRUE(blob.ok()) << blob.status().to_string();
  auto conn = (*tx)->connect(*blob, in(10s));
  ASSERT_TRUE(conn.ok()) << conn.status().to_string();
  std::vector<uint8_t> src((size_t{4} << 20) + 3, 7);
  auto region = (*tx)->register_memory(src.data(), src.size(), Device::cpu());
  ASSERT_TRUE(region.ok()) << region.status().to_string();
  auto h = (*conn)->post(**region, 0, src.size());  // a rendezvous: its lanes are wired up by now
  ASSERT_TRUE(h.ok()) << h.status().to_string();
  ASSERT_TRUE((*h)->wait(in(30s)).ok());
  const std::string info = ucx_endpoint_info(**conn);
  ASSERT_FALSE(info.empty());
  const bool shm = info.find("posix/") != std::string::npos || info.find("sysv/") != std::string::npos;
  EXPECT_TRUE(shm) << "no shared-memory lane:\n" << info;
  EXPECT_NE(info.find("cma/"), std::string::npos) << "no cma lane:\n" << info;
  conn->reset();
  (*tx)->shutdown();
  (*rx)->shutdown();
}

}  // namespace
}  // namespace ferry::transport::testing

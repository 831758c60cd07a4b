// The rank side of direct reads (transport/ipc_share.h) without a GPU: allocations of this
// process resolve to their own addresses, and the mappings of an exporter that exited are dropped
// when a new exporter announces itself (not on every announcement: a trainer of 18,867 allocations
// made that a kill() per mapping per announcement).
#include <sys/wait.h>
#include <unistd.h>

#include <vector>

#include <gtest/gtest.h>

#include "transport/common/socket.h"
#include "transport/ipc_share.h"

namespace ferry::transport {
namespace {

SharedAllocation allocation(uint64_t nonce, int pid, uint64_t id, const void* base, uint64_t size) {
  SharedAllocation a;
  a.id = id;
  a.handle = std::string(64, 'h');  // cudaIpcMemHandle_t's size; never opened for this process's own
  a.size = size;
  a.process_nonce = nonce;
  a.base = reinterpret_cast<uint64_t>(base);
  a.pid = pid;
  return a;
}

int exited_pid() {
  const pid_t pid = fork();
  if (pid == 0) _exit(0);
  int status = 0;
  waitpid(pid, &status, 0);
  return pid;
}

TEST(IpcImporter, DropsAnExitedExportersMappingsWhenANewExporterArrives) {
  if (!ipc_share_available()) GTEST_SKIP() << "built without CUDA";
  std::vector<char> mine(4096);
  const uint64_t self = net::process_nonce();
  IpcImporter importer(0);
  ASSERT_TRUE(importer.announce(allocation(self, getpid(), 1, mine.data(), mine.size())).ok());
  auto r = importer.resolve(self, 1, 100, 8);
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_EQ(*r, reinterpret_cast<const uint8_t*>(mine.data()) + 100);
  EXPECT_FALSE(importer.resolve(self, 1, 4090, 8).ok()) << "a piece past its allocation resolved";

  // An exporter that has exited, then more of its allocations: kept until a new exporter arrives.
  const int dead = exited_pid();
  for (uint64_t id = 10; id < 1000; ++id) {
    ASSERT_TRUE(importer.announce(allocation(77, dead, id, nullptr, 4096)).ok());
  }
  // Still known (announcing the exporter's later allocations does not sweep its earlier ones), so
  // mapping them is tried (which fails here: no GPU, and no real handle), not refused.
  for (uint64_t id : {10, 500, 999}) {
    auto kept = importer.resolve(77, id, 0, 8);
    if (!kept.ok()) {
      EXPECT_EQ(kept.status().message().find("never announced"), std::string::npos) << kept.status().to_string();
    }
  }
  ASSERT_TRUE(importer.announce(allocation(self + 1, getpid(), 2, mine.data(), mine.size())).ok());
  for (uint64_t id : {10, 500, 999}) {
    auto gone = importer.resolve(77, id, 0, 8);
    ASSERT_FALSE(gone.ok());
    EXPECT_NE(gone.status().message().find("never announced"), std::string::npos) << gone.status().to_string();
  }
  EXPECT_TRUE(importer.resolve(self, 1, 0, 8).ok()) << "a live exporter's mapping was dropped";
}

}  // namespace
}  // namespace ferry::transport

// The conformance suite's fixture, shared by its files: conformance_test.cc (the cases within one
// process, and the instantiation for every transport built) and conformance_process_test.cc (the
// cases against child processes).
#pragma once

#include "tests/common/scoped_env.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "tests/transport/harness.h"
#include "transport/transport.h"

namespace ferry::transport::testing {

struct TransportCase {
  std::string name;
  size_t large_bytes;   // the "large message" case; 1 GiB where it is cheap
  bool cross_process;   // peer-death cases run against a child process
  int devices_needed;   // GPUs both ends need (0: none)
  std::string label = {};    // test name suffix when it differs from name
  std::string ucx_tls = {};  // UCX_TLS for this case, unless the user set one
  int rx_device = 0;         // CUDA device of the receiving transport (device transports)
  int tx_device = 0;         // and of the sending ones
  std::string why_devices = {};  // said when a case skips for want of GPUs
};

// NVLink multicast stays off in this test process (and its children) unless the user chose.
inline const bool kNvlsOff = [] {
  setenv("NCCL_NVLS_ENABLE", "0", /*overwrite=*/0);
  return true;
}();

inline void PrintTo(const TransportCase& c, std::ostream* os) { *os << (c.label.empty() ? c.name : c.label); }

// Every transport built into this ferry, with the cases device transports need.
std::vector<TransportCase> built_cases();

using testutil::ScopedEnv;

struct Posted {
  std::unique_ptr<TransferHandle> handle;
  size_t size;
  uint64_t hash;
};

class Conformance : public ::testing::TestWithParam<TransportCase> {
 protected:
  void SetUp() override {
    const TransportCase& c = GetParam();
    (void)kNvlsOff;
    if (c.devices_needed > 0 && !cuda_device_available()) GTEST_SKIP() << "no CUDA device here";
    if (c.devices_needed > 0 && cuda_device_count() < c.devices_needed) {
      GTEST_SKIP() << c.why_devices << ": needs " << c.devices_needed << " CUDA devices, this machine shows "
                   << cuda_device_count();
    }
    if (!GetParam().ucx_tls.empty() && std::getenv("UCX_TLS") == nullptr) tls_.emplace("UCX_TLS", GetParam().ucx_tls);
    auto options = transport_options_from_settings();
    ASSERT_TRUE(options.ok()) << options.status().to_string();
    create_pair(*options);
  }

  // (Re)creates the receiving and the sending transport with `options`. Device transports take the
  // device current at creation: the receiver's, then the sender's (left current, so transports the
  // test body creates send from it too).
  void create_pair(const TransportOptions& options) {
    const TransportCase& c = GetParam();
    if (tx_) tx_->shutdown();
    if (rx_) rx_->shutdown();
    tx_.reset();
    rx_.reset();
    if (c.devices_needed > 0) {
      ASSERT_TRUE(use_device(c.rx_device));
    }
    auto rx = create_transport(c.name, options);
    // A built host transport must work here; only device transports may find no device.
    if (!rx.ok() && c.devices_needed > 0) GTEST_SKIP() << c.name << ": " << rx.status().to_string();
    ASSERT_TRUE(rx.ok()) << rx.status().to_string();
    rx_ = std::move(*rx);
    if (c.devices_needed > 0) {
      ASSERT_TRUE(use_device(c.tx_device));
    }
    auto tx = create_transport(c.name, options);
    ASSERT_TRUE(tx.ok()) << tx.status().to_string();
    tx_ = std::move(*tx);
    inbox_ = std::make_unique<Inbox>(rx_->capabilities().device_memory);
  }

  void TearDown() override {
    if (inbox_) inbox_->open_gate();
    if (tx_) tx_->shutdown();
    if (rx_) rx_->shutdown();
    tx_.reset();
    rx_.reset();
    tls_.reset();
  }

  int txd() const { return GetParam().tx_device; }

  std::string listen() {
    auto blob = rx_->listen(inbox_->callback(), inbox_->closed_callback(), suite_admit());
    EXPECT_TRUE(blob.ok()) << blob.status().to_string();
    return blob.ok() ? *blob : std::string();
  }

  std::unique_ptr<Connection> connect(Transport& t, const std::string& blob, std::string_view credential = kCredential,
                                      std::chrono::milliseconds within = 10s) {
    auto c = t.connect(blob, in(within), credential);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? std::move(*c) : nullptr;
  }

  // Posts one payload per (offset, size) from `src`, all before waiting on any.
  std::vector<Posted> post_all(Connection& c, Source& src, const std::vector<std::pair<size_t, size_t>>& items,
                               uint64_t sender) {
    std::vector<Posted> out;
    for (size_t i = 0; i < items.size(); ++i) {
      const auto [off, size] = items[i];
      const uint64_t h = src.write(off, size, sender, i);
      auto h_or = c.post(src.region(), off, size);
      EXPECT_TRUE(h_or.ok()) << h_or.status().to_string();
      if (!h_or.ok()) break;
      out.push_back({std::move(*h_or), size, h});
    }
    return out;
  }

  // Every posted payload arrived, whole and in order, after `first` earlier buckets.
  void expect_arrived(const std::vector<Posted>& posted, size_t first = 0) {
    ASSERT_TRUE(inbox_->wait_for_count(first + posted.size(), in(60s)))
        << "received " << inbox_->received().size() << " of " << first + posted.size();
    const auto got = inbox_->received();
    for (size_t i = 0; i < posted.size(); ++i) {
      EXPECT_EQ(got[first + i].size, posted[i].size) << "bucket " << i;
      EXPECT_EQ(got[first + i].hash, posted[i].hash) << "bucket " << i;
      EXPECT_EQ(got[first + i].peer, kIdentity) << "bucket " << i;
    }
  }

  std::optional<ScopedEnv> tls_;
  std::unique_ptr<Transport> rx_, tx_;
  std::unique_ptr<Inbox> inbox_;
};

}  // namespace ferry::transport::testing

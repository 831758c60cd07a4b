// The data-plane handshake: arbitrary bytes as what a peer sends first on a data connection (the
// credential frame of tcp, cuda_ipc and nccl: transport/admission.h), judged by a rank's admission
// (dataplane/credential.h's check_data_credential behind transport::admit_peer). The property: only a
// credential computed with the key of a sender the rank knows is admitted, as exactly that sender.
#include <array>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <string>
#include <string_view>

#include "core/log.h"
#include "dataplane/credential.h"
#include "transport/admission.h"

namespace {

using namespace ferry;

constexpr int kReceiver = 2;
const std::map<int, std::string> kKeys = {{1, std::string(32, 'a')}, {7, std::string(32, 'b')}};

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  ferry::logger().set_level(spdlog::level::off);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < transport::kCredentialHeaderBytes) return 0;
  std::array<uint8_t, transport::kCredentialHeaderBytes> header{};
  std::memcpy(header.data(), data, header.size());
  auto length = transport::credential_length(header);
  if (!length.ok()) return 0;  // refused before a byte more is read
  if (*length > transport::kMaxCredentialBytes) std::abort();
  const std::string_view rest(reinterpret_cast<const char*>(data + header.size()), size - header.size());
  if (rest.size() < *length) return 0;  // a peer that stops here is closed at the deadline
  const std::string_view credential = rest.substr(0, *length);
  const transport::AdmitCallback admit = [](std::string_view c) -> Result<transport::Admission> {
    FERRY_ASSIGN_OR_RETURN(const dataplane::DataCredential d,
                           dataplane::check_data_credential(c, kReceiver, [](int id) -> const std::string* {
                             auto it = kKeys.find(id);
                             return it == kKeys.end() ? nullptr : &it->second;
                           }));
    return transport::Admission{static_cast<int64_t>(d.sender), d.max_bucket_bytes};
  };
  constexpr uint64_t kDefaultLimit = uint64_t{1} << 30;
  auto granted = transport::admit_peer(admit, credential, "fuzz", "peer", kDefaultLimit);
  if (!granted.ok()) return 0;
  const int64_t who = granted->peer;
  // Admitted: it must be the very credential the sender's key gives for the limit it was granted
  // (the one it announced; 0 announced leaves the transport's default).
  auto it = kKeys.find(static_cast<int>(who));
  if (it == kKeys.end()) std::abort();
  const uint64_t announced = granted->max_bucket_bytes == kDefaultLimit ? 0 : granted->max_bucket_bytes;
  auto expected = dataplane::data_credential(it->second, static_cast<int>(who), kReceiver, announced);
  auto expected_default = dataplane::data_credential(it->second, static_cast<int>(who), kReceiver, kDefaultLimit);
  const bool matches = (expected.ok() && *expected == credential) ||
                       (expected_default.ok() && *expected_default == credential);
  if (!matches) std::abort();
  // And the frame a sender writes for it parses back to its length.
  const std::string frame = transport::credential_frame(credential);
  std::array<uint8_t, transport::kCredentialHeaderBytes> again{};
  std::memcpy(again.data(), frame.data(), again.size());
  auto n = transport::credential_length(again);
  if (!n.ok() || *n != credential.size()) std::abort();
  return 0;
}

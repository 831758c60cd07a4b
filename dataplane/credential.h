// Who may send to a rank, and how large its buckets may be. The coordinator gives every trainer a
// random key (Welcome.data_key) and tells each rank, in every update's Pause, the keys of that
// update's senders. A sender opens a data connection to rank `receiver` (its member id) with the
// credential
//   u32 sender member id || u64 largest bucket || HMAC-SHA256(key, "ferry-data/2" || u32 receiver
//                                                              || u32 sender || u64 largest bucket)
// (integers little-endian), and the rank admits it only with a matching key of a sender it was told
// of, taking from it buckets up to the largest one it announced: the sender's plan, not the rank's
// own settings, sizes what the connection carries.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::dataplane {

// HMAC-SHA256(key, message), raw 32 bytes.
Result<std::string> hmac_sha256(std::string_view key, std::string_view message);
// Equal secrets, compared in constant time for equal sizes.
bool same_secret(std::string_view a, std::string_view b);

inline constexpr size_t kDataCredentialBytes = 4 + 8 + 32;

Result<std::string> data_credential(const std::string& key, int sender, int receiver, uint64_t max_bucket_bytes);
// What a valid credential proves.
struct DataCredential {
  int sender = 0;
  uint64_t max_bucket_bytes = 0;
};
// The sender and its largest bucket when `credential` is a valid one for `receiver` under the key
// `keys` returns for its sender (null: no such sender); Unauthenticated otherwise, naming why.
Result<DataCredential> check_data_credential(std::string_view credential, int receiver,
                                             const std::function<const std::string*(int sender)>& keys);

}  // namespace ferry::dataplane

// Who may send to a rank. The coordinator gives every trainer a random key (Welcome.data_key) and
// tells each rank, in every update's Pause, the keys of that update's senders. A sender opens a data
// connection to rank `receiver` (its member id) with the credential
//   u32 sender member id (little-endian) || HMAC-SHA256(key, "ferry-data/1" || u32 receiver || u32 sender)
// and the rank admits it only with a matching key of a sender it was told of.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::dataplane {

// HMAC-SHA256(key, message), raw 32 bytes.
Result<std::string> hmac_sha256(std::string_view key, std::string_view message);
// Equal secrets, compared in constant time for equal sizes.
bool same_secret(std::string_view a, std::string_view b);

Result<std::string> data_credential(const std::string& key, int sender, int receiver);
// The sender's member id when `credential` is a valid one for `receiver` under the key `keys`
// returns for its sender (null: no such sender); Unauthenticated otherwise, naming why.
Result<int> check_data_credential(std::string_view credential, int receiver,
                                  const std::function<const std::string*(int sender)>& keys);

}  // namespace ferry::dataplane

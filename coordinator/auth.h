// Joining with a shared token: the coordinator sends a fresh random nonce, the member answers with
// HMAC-SHA256(token, nonce), the coordinator compares in constant time.
#pragma once

#include <functional>
#include <string>
#include <string_view>

#include "core/status.h"

namespace ferry::coordinator {

// 32 random bytes from OpenSSL's CSPRNG.
Result<std::string> make_nonce();
// HMAC-SHA256(token, nonce), raw 32 bytes.
Result<std::string> answer_challenge(const std::string& token, const std::string& nonce);
// True when `answer` is the right answer for `nonce` under `token` (constant-time comparison).
bool check_answer(const std::string& token, const std::string& nonce, const std::string& answer);

// Data connections. The coordinator gives every trainer a random key (Welcome.data_key) and tells
// each rank, in every update's Pause, the keys of that update's senders. A sender opens a data
// connection to rank `receiver` (its member id) with the credential
//   u32 sender member id (little-endian) || HMAC-SHA256(key, "ferry-data/1" || u32 receiver || u32 sender)
// and the rank admits it only with a matching key of a sender it was told of.
Result<std::string> data_credential(const std::string& key, int sender, int receiver);
// The sender's member id when `credential` is a valid one for `receiver` under the key `keys`
// returns for its sender (null: no such sender); Unauthenticated otherwise, naming why.
Result<int> check_data_credential(std::string_view credential, int receiver,
                                  const std::function<const std::string*(int sender)>& keys);

}  // namespace ferry::coordinator

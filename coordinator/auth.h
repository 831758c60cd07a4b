// Joining with a shared token: the coordinator sends a fresh random nonce, the member answers with
// HMAC-SHA256(token, nonce), the coordinator compares in constant time.
#pragma once

#include <string>

#include "core/status.h"

namespace ferry::coordinator {

// 32 random bytes from OpenSSL's CSPRNG.
Result<std::string> make_nonce();
// HMAC-SHA256(token, nonce), raw 32 bytes.
Result<std::string> answer_challenge(const std::string& token, const std::string& nonce);
// True when `answer` is the right answer for `nonce` under `token` (constant-time comparison).
bool check_answer(const std::string& token, const std::string& nonce, const std::string& answer);

// Data connections prove themselves with credentials of dataplane/credential.h.

}  // namespace ferry::coordinator

#include "coordinator/auth.h"

#include <openssl/rand.h>

#include "dataplane/credential.h"

namespace ferry::coordinator {

Result<std::string> make_nonce() {
  std::string nonce(32, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    return Status::internal("RAND_bytes failed to produce a nonce");
  }
  return nonce;
}

Result<std::string> answer_challenge(const std::string& token, const std::string& nonce) {
  return dataplane::hmac_sha256(token, nonce);
}

bool check_answer(const std::string& token, const std::string& nonce, const std::string& answer) {
  auto expected = answer_challenge(token, nonce);
  return expected.ok() && dataplane::same_secret(answer, *expected);
}

}  // namespace ferry::coordinator

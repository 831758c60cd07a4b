#include "coordinator/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

namespace ferry::coordinator {

Result<std::string> make_nonce() {
  std::string nonce(32, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(nonce.data()), static_cast<int>(nonce.size())) != 1) {
    return Status::internal("RAND_bytes failed to produce a nonce");
  }
  return nonce;
}

Result<std::string> answer_challenge(const std::string& token, const std::string& nonce) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()), reinterpret_cast<const unsigned char*>(nonce.data()),
           nonce.size(), mac, &len) == nullptr) {
    return Status::internal("HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool check_answer(const std::string& token, const std::string& nonce, const std::string& answer) {
  auto expected = answer_challenge(token, nonce);
  if (!expected.ok() || answer.size() != expected->size()) return false;
  return CRYPTO_memcmp(answer.data(), expected->data(), answer.size()) == 0;
}

}  // namespace ferry::coordinator

#include "coordinator/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <fmt/format.h>

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

namespace {

constexpr std::string_view kDataLabel = "ferry-data/1";

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

uint32_t get_u32(std::string_view in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(in[static_cast<size_t>(i)])) << (8 * i);
  return v;
}

std::string data_message(int sender, int receiver) {
  std::string m(kDataLabel);
  put_u32(m, static_cast<uint32_t>(receiver));
  put_u32(m, static_cast<uint32_t>(sender));
  return m;
}

}  // namespace

Result<std::string> data_credential(const std::string& key, int sender, int receiver) {
  if (key.empty()) return Status::failed_precondition("no data key: this trainer has not joined a coordinator");
  FERRY_ASSIGN_OR_RETURN(std::string mac, answer_challenge(key, data_message(sender, receiver)));
  std::string out;
  put_u32(out, static_cast<uint32_t>(sender));
  return out + mac;
}

Result<int> check_data_credential(std::string_view credential, int receiver,
                                  const std::function<const std::string*(int sender)>& keys) {
  if (credential.size() != 4 + 32) {
    return Status::unauthenticated(fmt::format("a data connection presented {} bytes of credential; 36 expected",
                                               credential.size()));
  }
  const int sender = static_cast<int>(get_u32(credential));
  const std::string* key = keys(sender);
  if (key == nullptr) {
    return Status::unauthenticated(
        fmt::format("a data connection claims to be member {}, which is no sender of this rank's update", sender));
  }
  if (!check_answer(*key, data_message(sender, receiver), std::string(credential.substr(4)))) {
    return Status::unauthenticated(fmt::format("a data connection claiming member {} proved it wrongly", sender));
  }
  return sender;
}

}  // namespace ferry::coordinator

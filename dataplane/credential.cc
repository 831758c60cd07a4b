#include "dataplane/credential.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <fmt/format.h>

namespace ferry::dataplane {

Result<std::string> hmac_sha256(std::string_view key, std::string_view message) {
  unsigned char mac[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  if (HMAC(EVP_sha256(), key.data(), static_cast<int>(key.size()), reinterpret_cast<const unsigned char*>(message.data()),
           message.size(), mac, &len) == nullptr) {
    return Status::internal("HMAC-SHA256 failed");
  }
  return std::string(reinterpret_cast<const char*>(mac), len);
}

bool same_secret(std::string_view a, std::string_view b) {
  return a.size() == b.size() && CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

namespace {

constexpr std::string_view kDataLabel = "ferry-data/2";

void put_u32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_u64(std::string& out, uint64_t v) {
  put_u32(out, static_cast<uint32_t>(v));
  put_u32(out, static_cast<uint32_t>(v >> 32));
}

uint32_t get_u32(std::string_view in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(static_cast<uint8_t>(in[static_cast<size_t>(i)])) << (8 * i);
  return v;
}

uint64_t get_u64(std::string_view in) { return get_u32(in) | (static_cast<uint64_t>(get_u32(in.substr(4))) << 32); }

std::string data_message(int sender, int receiver, uint64_t max_bucket_bytes) {
  std::string m(kDataLabel);
  put_u32(m, static_cast<uint32_t>(receiver));
  put_u32(m, static_cast<uint32_t>(sender));
  put_u64(m, max_bucket_bytes);
  return m;
}

}  // namespace

Result<std::string> data_credential(const std::string& key, int sender, int receiver, uint64_t max_bucket_bytes) {
  if (key.empty()) return Status::failed_precondition("no data key: this trainer has not joined a coordinator");
  FERRY_ASSIGN_OR_RETURN(std::string mac, hmac_sha256(key, data_message(sender, receiver, max_bucket_bytes)));
  std::string out;
  put_u32(out, static_cast<uint32_t>(sender));
  put_u64(out, max_bucket_bytes);
  return out + mac;
}

Result<DataCredential> check_data_credential(std::string_view credential, int receiver,
                                             const std::function<const std::string*(int sender)>& keys) {
  if (credential.size() != kDataCredentialBytes) {
    return Status::unauthenticated(fmt::format("a data connection presented {} bytes of credential; {} expected",
                                               credential.size(), kDataCredentialBytes));
  }
  DataCredential c;
  c.sender = static_cast<int>(get_u32(credential));
  c.max_bucket_bytes = get_u64(credential.substr(4));
  const std::string* key = keys(c.sender);
  if (key == nullptr || key->empty()) {
    return Status::unauthenticated(
        fmt::format("a data connection claims to be member {}, which is no sender of this rank's update", c.sender));
  }
  auto expected = hmac_sha256(*key, data_message(c.sender, receiver, c.max_bucket_bytes));
  if (!expected.ok() || !same_secret(credential.substr(12), *expected)) {
    return Status::unauthenticated(fmt::format("a data connection claiming member {} proved it wrongly", c.sender));
  }
  return c;
}

}  // namespace ferry::dataplane

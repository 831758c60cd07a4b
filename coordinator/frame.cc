#include "coordinator/frame.h"

#include <fmt/format.h>

namespace ferry::coordinator {

std::string encode_frame(const wire::Envelope& env) {
  std::string body;
  env.SerializeToString(&body);
  std::string frame(kFrameHeaderBytes, '\0');
  const auto n = static_cast<uint32_t>(body.size());
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) frame[i] = static_cast<char>((n >> (8 * i)) & 0xff);
  return frame + body;
}

Result<uint32_t> frame_body_size(const uint8_t (&header)[kFrameHeaderBytes], uint64_t max_frame_bytes,
                                 std::string_view peer) {
  uint32_t n = 0;
  for (size_t i = kFrameHeaderBytes; i-- > 0;) n = (n << 8) | header[i];
  if (n > max_frame_bytes) {
    return Status::resource_exhausted(
        fmt::format("frame of {} bytes from {} exceeds FERRY_MAX_FRAME_BYTES={}", n, peer, max_frame_bytes));
  }
  return n;
}

Status parse_frame_body(const std::string& body, std::string_view peer, wire::Envelope* env) {
  if (!env->ParseFromString(body) || env->body_case() == wire::Envelope::BODY_NOT_SET) {
    return Status::invalid_argument(fmt::format("malformed control frame from {}", peer));
  }
  return ok_status();
}

Result<size_t> decode_frame(std::string_view bytes, uint64_t max_frame_bytes, std::string_view peer,
                            wire::Envelope* env) {
  if (bytes.size() < kFrameHeaderBytes) {
    return Status::unavailable(
        fmt::format("control frame from {} ends after {} of its {} header bytes", peer, bytes.size(), kFrameHeaderBytes));
  }
  uint8_t header[kFrameHeaderBytes];
  for (size_t i = 0; i < kFrameHeaderBytes; ++i) header[i] = static_cast<uint8_t>(bytes[i]);
  FERRY_ASSIGN_OR_RETURN(const uint32_t n, frame_body_size(header, max_frame_bytes, peer));
  const std::string_view rest = bytes.substr(kFrameHeaderBytes);
  if (rest.size() < n) {
    return Status::unavailable(
        fmt::format("control frame from {} ends after {} of its {} body bytes", peer, rest.size(), n));
  }
  FERRY_RETURN_IF_ERROR(parse_frame_body(std::string(rest.substr(0, n)), peer, env));
  return kFrameHeaderBytes + n;
}

}  // namespace ferry::coordinator

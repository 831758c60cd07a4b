// Control-plane framing: a 4-byte little-endian body length, then one serialized Envelope. Channel
// reads every frame through these functions; the frame fuzzer (fuzz/) drives them on arbitrary bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "core/status.h"
#include "proto/ferry.pb.h"

namespace ferry::coordinator {

inline constexpr size_t kFrameHeaderBytes = 4;

std::string encode_frame(const wire::Envelope& env);

// The body length that a frame header announces; ResourceExhausted above `max_frame_bytes`.
// `peer` names the sender in the error.
Result<uint32_t> frame_body_size(const uint8_t (&header)[kFrameHeaderBytes], uint64_t max_frame_bytes,
                                 std::string_view peer);

// Parses a frame body into `env`; InvalidArgument when it does not parse or carries no message.
Status parse_frame_body(const std::string& body, std::string_view peer, wire::Envelope* env);

// Decodes the frame at the start of `bytes` into `env` and returns the bytes it took; Unavailable
// when `bytes` ends inside the frame, as a connection closed mid-frame is.
Result<size_t> decode_frame(std::string_view bytes, uint64_t max_frame_bytes, std::string_view peer,
                            wire::Envelope* env);

}  // namespace ferry::coordinator

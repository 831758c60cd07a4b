// Arbitrary bytes as a control connection's stream: frames are decoded with the functions Channel
// reads with until the stream ends or a frame is refused. Every refusal must be a Status; every frame
// that decodes must survive a re-encode unchanged.
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include <google/protobuf/stubs/logging.h>

#include "coordinator/frame.h"

namespace {

// Small enough that oversized frames are within a fuzzer's reach.
constexpr uint64_t kMaxFrame = 64 * 1024;

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  google::protobuf::SetLogHandler(nullptr);  // every non-UTF-8 string field would log a line
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace ferry::coordinator;
  std::string_view rest(reinterpret_cast<const char*>(data), size);
  while (!rest.empty()) {
    ferry::wire::Envelope env;
    auto used = decode_frame(rest, kMaxFrame, "fuzz", &env);
    if (!used.ok()) {
      if (used.status().message().empty()) std::abort();
      break;
    }
    if (*used < kFrameHeaderBytes || *used > rest.size()) std::abort();
    rest.remove_prefix(*used);

    const std::string again = encode_frame(env);
    ferry::wire::Envelope back;
    auto n = decode_frame(again, UINT64_MAX, "fuzz", &back);
    if (!n.ok() || *n != again.size() || back.SerializeAsString() != env.SerializeAsString()) std::abort();
  }
  return 0;
}

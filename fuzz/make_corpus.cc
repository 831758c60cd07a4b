// Writes the seed corpus of the fuzz targets: valid frames of each message kind, conversations that
// walk the update machine through its phases, buckets as BucketBuilder makes them, and a few
// malformed inputs of each. Usage: ferry-fuzz-corpus fuzz/corpus
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "core/version.h"
#include "coordinator/auth.h"
#include "dataplane/credential.h"
#include "dataplane/bucket.h"
#include "dataplane/delta.h"
#include "coordinator/frame.h"
#include "transport/admission.h"

namespace {

using namespace ferry;
using namespace ferry::coordinator;
using namespace ferry::dataplane;
namespace fs = std::filesystem;

fs::path g_root;

void put(const std::string& target, const std::string& name, const std::string& bytes) {
  const fs::path dir = g_root / target;
  fs::create_directories(dir);
  std::ofstream(dir / name, std::ios::binary) << bytes;
}

std::string u32(uint32_t v) {
  std::string s(4, '\0');
  for (int i = 0; i < 4; ++i) s[static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
  return s;
}

void meta(wire::TensorMeta* t, const std::string& name, std::vector<int64_t> shape) {
  t->set_name(name);
  t->set_dtype("bf16");
  for (int64_t d : shape) t->add_shape(d);
}

// The registration of a rollout rank of a TP-2 replica holding half the rows of one 4x4 tensor.
wire::Envelope registration(int replica, int tp_rank) {
  wire::Envelope e;
  auto* h = e.mutable_registration();
  auto* s = h->mutable_spec();
  s->set_replica(replica);
  s->set_tp_rank(tp_rank);
  s->set_tp_size(2);
  meta(s->add_expects(), "w", {4, 4});
  auto* p = s->add_params();
  p->set_name("w");
  p->set_layer("model.norm");
  p->add_shape(2);
  p->add_shape(4);
  p->set_source_dtype("bf16");
  p->set_scheme("none");
  auto* sl = p->add_slices();
  sl->set_source("w");
  sl->add_src_offset(2 * tp_rank);
  sl->add_src_offset(0);
  sl->add_src_size(2);
  sl->add_src_size(4);
  sl->add_dst_offset(0);
  sl->add_dst_offset(0);
  auto* ep = h->add_endpoints();
  ep->set_transport("tcp");
  ep->set_blob("127.0.0.1:1");
  return e;
}

// The first rank, with its slice offset or its parameter's shape changed to what fuzz_handlers found.
wire::Envelope registration_bad(int64_t row, std::vector<int64_t> shape) {
  wire::Envelope e = registration(0, 0);
  auto* p = e.mutable_registration()->mutable_spec()->mutable_params(0);
  p->mutable_slices(0)->set_src_offset(0, row);
  p->clear_shape();
  for (int64_t d : shape) p->add_shape(d);
  return e;
}

wire::Envelope hello(const std::string& role) {
  wire::Envelope e;
  e.mutable_hello()->set_protocol_version(kProtocolVersion);
  e.mutable_hello()->set_role(role);
  return e;
}

wire::Envelope start(uint64_t version, std::vector<int64_t> shape = {4, 4}) {
  wire::Envelope e;
  e.mutable_start_update()->set_version(version);
  meta(e.mutable_start_update()->add_manifest(), "w", std::move(shape));
  return e;
}

wire::Envelope pause_ack(uint64_t version, int code = 0) {
  wire::Envelope e;
  e.mutable_pause_ack()->set_version(version);
  e.mutable_pause_ack()->mutable_status()->set_code(code);
  if (code) e.mutable_pause_ack()->mutable_status()->set_message("engine refused to pause");
  return e;
}

wire::Envelope finish(uint64_t version, int ranks) {
  wire::Envelope e;
  e.mutable_finish_update()->set_version(version);
  for (int i = 0; i < ranks; ++i) e.mutable_finish_update()->add_buckets(1);
  e.mutable_finish_update()->set_bytes(64);
  return e;
}

wire::Envelope finalized(uint64_t version) {
  wire::Envelope e;
  e.mutable_finalized()->set_version(version);
  e.mutable_finalized()->mutable_status();
  e.mutable_finalized()->set_bytes(16);
  e.mutable_finalized()->set_registered(1);
  return e;
}

wire::Envelope resume_ack(uint64_t version, int code = 0) {
  wire::Envelope e;
  e.mutable_resume_ack()->set_version(version);
  e.mutable_resume_ack()->mutable_status()->set_code(code);
  if (code) e.mutable_resume_ack()->mutable_status()->set_message("engine failed to resume");
  return e;
}

wire::Envelope abort_update(uint64_t version) {
  wire::Envelope e;
  e.mutable_abort_update()->set_version(version);
  e.mutable_abort_update()->set_reason("send failed");
  return e;
}

wire::Envelope abort_ack(uint64_t version, bool rolled_back) {
  wire::Envelope e;
  e.mutable_abort_ack()->set_version(version);
  e.mutable_abort_ack()->set_rolled_back(rolled_back);
  e.mutable_abort_ack()->set_serving_version(rolled_back ? version - 1 : 0);
  return e;
}

wire::Envelope heartbeat() {
  wire::Envelope e;
  e.mutable_heartbeat();
  return e;
}

// A conversation for fuzz_handlers: options byte, then (slot, frame) records or close records.
class Script {
 public:
  explicit Script(uint8_t options) : bytes_(1, static_cast<char>(options)) {}
  Script& send(int slot, const wire::Envelope& e) {
    bytes_ += static_cast<char>(slot);
    bytes_ += encode_frame(e);
    return *this;
  }
  // A rollout rank's join: its hello, then its registration.
  Script& join_rank(int slot, int replica, int tp_rank) {
    return send(slot, hello("rollout")).send(slot, registration(replica, tp_rank));
  }
  Script& open(int slot) {
    bytes_ += static_cast<char>(0x40 | slot);
    return *this;
  }
  Script& raw(int slot, const std::string& frame) {
    bytes_ += static_cast<char>(slot);
    bytes_ += frame;
    return *this;
  }
  Script& lose(int slot, bool reaped = false) {
    bytes_ += static_cast<char>(0x80 | (reaped ? 0x40 : 0) | slot);
    return *this;
  }
  const std::string& bytes() const { return bytes_; }

 private:
  std::string bytes_;
};

// Trainer in slot 0, two ranks of replica 0 in slots 1 and 2, all paused for update v1 (transferring).
Script joined_and_paused() {
  Script s(0);
  s.send(0, hello("trainer")).join_rank(1, 0, 0).join_rank(2, 0, 1);
  s.send(0, start(1)).send(1, pause_ack(1)).send(2, pause_ack(1));
  return s;
}

void frames() {
  wire::Envelope challenge;
  challenge.mutable_challenge()->set_protocol_version(kProtocolVersion);
  challenge.mutable_challenge()->set_nonce(std::string(32, 'n'));
  challenge.mutable_challenge()->set_token_required(true);
  wire::Envelope status;
  status.mutable_status_request();
  wire::Envelope reply;
  reply.mutable_status_reply()->set_phase("idle");
  auto* m = reply.mutable_status_reply()->add_members();
  m->set_member_id(1);
  m->set_role("rollout");
  m->set_state("serving");
  wire::Envelope welcome;
  welcome.mutable_welcome()->set_member_id(3);

  put("frame", "challenge", encode_frame(challenge));
  put("frame", "registration", encode_frame(registration(0, 1)));
  put("frame", "hello_trainer", encode_frame(hello("trainer")));
  put("frame", "welcome", encode_frame(welcome));
  put("frame", "start_update", encode_frame(start(7)));
  put("frame", "pause_ack", encode_frame(pause_ack(7, 10)));
  put("frame", "finish_update", encode_frame(finish(7, 2)));
  put("frame", "finalized", encode_frame(finalized(7)));
  put("frame", "resume_ack", encode_frame(resume_ack(7)));
  put("frame", "abort_ack", encode_frame(abort_ack(7, true)));
  put("frame", "status_reply", encode_frame(reply));
  put("frame", "three_frames", encode_frame(status) + encode_frame(heartbeat()) + encode_frame(resume_ack(2)));

  const std::string h = encode_frame(registration(1, 0));
  put("frame", "bad_oversized", u32(0xffffffffu) + "xxxx");
  put("frame", "bad_truncated_body", h.substr(0, h.size() / 2));
  put("frame", "bad_truncated_header", h.substr(0, 2));
  put("frame", "bad_empty_body", u32(0));
  put("frame", "bad_garbage_body", u32(6) + std::string("\xff\xff\xff\xff\xff\x01", 6));
  put("frame", "bad_after_good", encode_frame(heartbeat()) + u32(3) + "\x0a\x05z");
}

void handlers() {
  put("handlers", "update_ok", joined_and_paused()
                                   .send(0, finish(1, 2))
                                   .send(1, finalized(1))
                                   .send(2, finalized(1))
                                   .send(1, resume_ack(1))
                                   .send(2, resume_ack(1))
                                   .send(0, start(2))
                                   .bytes());
  put("handlers", "abort_then_rollback", Script(0)
                                             .send(0, hello("trainer"))
                                             .join_rank(1, 0, 0)
                                             .join_rank(2, 0, 1)
                                             .send(0, start(1))
                                             .send(1, pause_ack(1, 4))
                                             .send(1, abort_ack(1, true))
                                             .send(2, abort_ack(1, true))
                                             .bytes());
  put("handlers", "rank_lost_mid_transfer",
      joined_and_paused().lose(2).send(0, finish(1, 2)).send(1, abort_ack(1, false)).bytes());
  put("handlers", "trainer_reaped", joined_and_paused().lose(0, true).send(3, hello("trainer")).bytes());
  put("handlers", "deadlines_pass", Script(1)
                                        .send(0, hello("trainer"))
                                        .join_rank(1, 0, 0)
                                        .join_rank(2, 0, 1)
                                        .send(0, start(1))
                                        .send(1, abort_ack(1, true))
                                        .send(0, start(2))
                                        .bytes());
  put("handlers", "bad_manifest", Script(0)
                                      .send(0, hello("trainer"))
                                      .join_rank(1, 0, 0)
                                      .join_rank(2, 0, 1)
                                      .send(0, start(1, {4, 5}))
                                      .send(0, start(1))
                                      .send(0, start(2))
                                      .bytes());
  put("handlers", "second_start_and_bad_finish",
      joined_and_paused().send(0, start(5)).send(0, finish(1, 3)).send(0, finish(9, 2)).bytes());
  put("handlers", "regress_slice_offset_overflow",
      Script(0).send(0, hello("trainer")).send(1, hello("rollout")).send(1, registration_bad(INT64_MAX, {2, 4})).send(0, start(1)).bytes());
  put("handlers", "regress_shape_overflow",
      Script(0).send(0, hello("trainer")).send(1, hello("rollout")).send(1, registration_bad(0, {INT64_C(1) << 61, 4})).send(0, start(1)).bytes());
  put("handlers", "token_required", Script(2).send(0, hello("trainer")).join_rank(1, 0, 0).bytes());
  put("handlers", "resume_hook_fails_then_retried", joined_and_paused()
                                                        .send(0, finish(1, 2))
                                                        .send(1, finalized(1))
                                                        .send(2, finalized(1))
                                                        .send(1, resume_ack(1, 14))
                                                        .send(2, resume_ack(1))
                                                        .send(1, resume_ack(1))
                                                        .send(0, start(2))
                                                        .bytes());
  put("handlers", "trainer_aborts", joined_and_paused().send(0, abort_update(1)).send(0, abort_update(1)).send(0, start(2)).bytes());
  put("handlers", "replica_missing_a_rank",
      Script(0).send(0, hello("trainer")).join_rank(1, 0, 0).join_rank(2, 0, 1).lose(2).send(0, start(1)).bytes());
  put("handlers", "rank_rejoins_in_place",
      joined_and_paused().join_rank(3, 0, 1).send(0, finish(1, 2)).send(0, start(2)).bytes());
  put("handlers", "pending_flood_and_reap", Script(0)
                                                .send(0, hello("trainer"))
                                                .open(1)
                                                .open(2)
                                                .send(3, hello("rollout"))
                                                .send(4, heartbeat())
                                                .join_rank(5, 0, 0)
                                                .lose(0, true)
                                                .bytes());
  put("handlers", "preauth_frame_over_cap", Script(0).raw(1, u32(8192) + std::string(8192, 'x')).send(0, hello("trainer")).bytes());
  put("handlers", "unexpected_and_early", Script(0)
                                              .send(0, start(1))
                                              .send(0, hello("observer"))
                                              .send(0, hello("observer"))
                                              .send(1, hello("nobody"))
                                              .send(2, heartbeat())
                                              .bytes());
}

void buckets() {
  auto bucket = [](bool checksum, int pieces) {
    BucketBuilder b(4096);
    b.reset(3, 1, 7);
    for (int i = 0; i < pieces; ++i) {
      uint8_t* p = b.add_piece(static_cast<uint32_t>(i), Region{{0, 2 * i}, {2, 2}}, DType::kBF16, 8);
      for (int k = 0; k < 8; ++k) p[k] = static_cast<uint8_t>(i * 8 + k);
    }
    auto n = b.seal(checksum);
    return std::string(reinterpret_cast<const char*>(b.data()), n.ok() ? *n : 0);
  };
  const std::string ok = bucket(false, 2);
  put("bucket", "two_pieces", ok);
  put("bucket", "two_pieces_checksum", bucket(true, 2));
  put("bucket", "empty", bucket(false, 0));
  std::string corrupt = bucket(true, 3);
  corrupt[3] ^= 1;
  put("bucket", "bad_checksum", corrupt);
  put("bucket", "bad_magic", ok.substr(0, ok.size() - 1) + "X");
  put("bucket", "bad_header_length", ok.substr(0, ok.size() - 8) + u32(0x7fffffff) + ok.substr(ok.size() - 4));
  put("bucket", "bad_short", ok.substr(ok.size() - 6));
  // Delta pieces against version 2: 3 of 64 bf16 elements changed, as runs; and 40 of 1024 as XORs
  // in a zstd frame (FERRY_DELTA_ZSTD).
  for (const bool zstd : {false, true}) {
    const size_t n = zstd ? 1024 : 64;
    std::vector<uint8_t> before(n * 2, 0), after(n * 2, 0), encoded;
    if (zstd) {
      for (size_t e = 0; e < n; e += 25) after[e * 2] = 1;
    } else {
      after[10] = after[11] = after[90] = 1;
    }
    const DeltaChoice c = encode_delta(before.data(), after.data(), n, 2, false, encoded, zstd);
    uint32_t field = static_cast<uint32_t>(c.encoding);
    if (zstd) field |= kDeltaXor | (compress_delta(encoded, 1) ? kDeltaZstd : 0);
    BucketBuilder b(8192);
    b.reset(3, 1, 8);
    const int64_t rows = static_cast<int64_t>(n / 8);
    uint8_t* at = b.add_delta_piece(0, Region{{0, 0}, {rows, 8}}, DType::kBF16, n * 2, field, 2, encoded.size());
    std::copy(encoded.begin(), encoded.end(), at);
    auto sealed = b.seal(false);
    put("bucket", zstd ? "delta_zstd" : "delta_runs",
        std::string(reinterpret_cast<const char*>(b.data()), sealed.ok() ? *sealed : 0));
  }

  wire::BucketHeader h;
  auto* p = h.add_pieces();
  p->set_offset(4);
  p->set_bytes(8);
  p->add_size(2);
  h.set_payload_bytes(8);
  const std::string hb = h.SerializeAsString();
  put("bucket", "bad_piece_outside", std::string(8, 'p') + hb + u32(static_cast<uint32_t>(hb.size())) + u32(kBucketMagic));
}

// What a peer sends first on a data connection, for fuzz_admission (its keys and receiver).
void admission() {
  auto frame = [](const std::string& key, int sender) {
    auto c = data_credential(key, sender, 2, uint64_t{64} << 20);
    return transport::credential_frame(c.ok() ? *c : std::string());
  };
  const std::string a(32, 'a'), b(32, 'b');
  put("admission", "sender_1", frame(a, 1));
  put("admission", "sender_7", frame(b, 7));
  put("admission", "wrong_key", frame(b, 1));
  put("admission", "unknown_sender", frame(a, 3));
  put("admission", "empty", transport::credential_frame(""));
  const std::string ok = frame(a, 1);
  put("admission", "bad_magic", "XXXX" + ok.substr(4));
  put("admission", "bad_oversized", ok.substr(0, 4) + u32(1u << 20) + ok.substr(8));
  put("admission", "bad_truncated", ok.substr(0, ok.size() - 3));
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  g_root = argv[1];
  frames();
  handlers();
  buckets();
  admission();
  return 0;
}

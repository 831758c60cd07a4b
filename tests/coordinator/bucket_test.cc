#include "coordinator/bucket.h"

#include <cstring>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

namespace ferry::coordinator {
namespace {

using ::testing::HasSubstr;

struct Built {
  std::vector<uint8_t> bytes;
};

Built build(bool checksum) {
  BucketBuilder b(4096);
  b.reset(7, 0, 3);
  uint8_t* p = b.add_piece(2, Region{{4, 0}, {2, 8}}, DType::kBF16, 32);
  for (int i = 0; i < 32; ++i) p[i] = static_cast<uint8_t>(i);
  p = b.add_piece(5, Region{{0}, {4}}, DType::kF32, 16);
  std::memset(p, 0xab, 16);
  auto n = b.seal(checksum);
  EXPECT_TRUE(n.ok());
  return {std::vector<uint8_t>(b.data(), b.data() + *n)};
}

TEST(Bucket, RoundTripsPiecesAndPayload) {
  Built b = build(true);
  wire::BucketHeader h;
  ASSERT_TRUE(decode_bucket(b.bytes.data(), b.bytes.size(), &h).ok());
  EXPECT_EQ(h.version(), 7u);
  EXPECT_EQ(h.seq(), 3u);
  ASSERT_EQ(h.pieces_size(), 2);
  EXPECT_EQ(h.pieces(0).param(), 2u);
  EXPECT_EQ(h.pieces(0).dst_offset(0), 4);
  EXPECT_EQ(h.pieces(0).size(1), 8);
  EXPECT_EQ(h.pieces(0).dtype(), "bf16");
  EXPECT_EQ(h.pieces(1).offset(), 32u);
  EXPECT_EQ(b.bytes[31], 31);
  EXPECT_EQ(b.bytes[32], 0xab);
}

TEST(Bucket, CorruptPayloadFailsChecksum) {
  Built b = build(true);
  b.bytes[5] ^= 0x40;
  wire::BucketHeader h;
  Status st = decode_bucket(b.bytes.data(), b.bytes.size(), &h);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss);
  EXPECT_THAT(st.message(), HasSubstr("checksum"));
}

TEST(Bucket, WithoutChecksumCorruptionIsNotDetectedHere) {
  Built b = build(false);
  b.bytes[5] ^= 0x40;
  wire::BucketHeader h;
  EXPECT_TRUE(decode_bucket(b.bytes.data(), b.bytes.size(), &h).ok());
  EXPECT_EQ(h.checksum(), 0u);
}

TEST(Bucket, BadTrailerAndLengthsAreDataLoss) {
  Built b = build(false);
  wire::BucketHeader h;
  auto bad_magic = b.bytes;
  bad_magic.back() ^= 1;
  EXPECT_EQ(decode_bucket(bad_magic.data(), bad_magic.size(), &h).code(), StatusCode::kDataLoss);
  auto bad_len = b.bytes;
  bad_len[bad_len.size() - 8] = 0xff;
  bad_len[bad_len.size() - 7] = 0xff;
  EXPECT_EQ(decode_bucket(bad_len.data(), bad_len.size(), &h).code(), StatusCode::kDataLoss);
  EXPECT_EQ(decode_bucket(b.bytes.data(), 5, &h).code(), StatusCode::kDataLoss);
  // Dropping payload bytes leaves pieces pointing past the payload.
  std::vector<uint8_t> short_payload(b.bytes.begin() + 16, b.bytes.end());
  EXPECT_EQ(decode_bucket(short_payload.data(), short_payload.size(), &h).code(), StatusCode::kDataLoss);
}

TEST(Bucket, RoomShrinksAsPiecesArrive) {
  BucketBuilder b(2048);
  b.reset(1, 0, 0);
  const size_t room = b.payload_room();
  ASSERT_GT(room, 0u);
  b.add_piece(0, Region{{0}, {100}}, DType::kU8, 100);
  EXPECT_LT(b.payload_room(), room - 100 + 1);
  while (b.payload_room() >= 64) b.add_piece(0, Region{{0}, {64}}, DType::kU8, 64);
  EXPECT_TRUE(b.seal(true).ok());
}

// Direct pieces carry where the bytes lie in a shared allocation instead of bytes; announced
// allocations and the sender's nonce travel in the header.
TEST(Bucket, DirectPiecesCarryReferencesNotBytes) {
  BucketBuilder b(4096);
  b.reset(9, 0, 1);
  b.set_sender_nonce(0x1234);
  wire::IpcAllocation a;
  a.set_id(77);
  a.set_handle(std::string(64, 'h'));
  a.set_size(1 << 20);
  a.set_pid(42);
  b.add_allocation(a);
  b.add_ref_piece(3, Region{{0, 0}, {4, 16}}, DType::kBF16, 128, 77, 4096, 64, 4);
  uint8_t* p = b.add_piece(4, Region{{0}, {2}}, DType::kF32, 8);
  std::memset(p, 0x11, 8);
  auto n = b.seal(true);
  ASSERT_TRUE(n.ok());
  wire::BucketHeader h;
  ASSERT_TRUE(decode_bucket(b.data(), *n, &h).ok());
  EXPECT_EQ(h.payload_bytes(), 8u);  // only the ordinary piece's bytes
  EXPECT_EQ(h.sender_nonce(), 0x1234u);
  ASSERT_EQ(h.allocations_size(), 1);
  EXPECT_EQ(h.allocations(0).id(), 77u);
  EXPECT_EQ(h.allocations(0).handle().size(), 64u);
  ASSERT_EQ(h.pieces_size(), 2);
  EXPECT_EQ(h.pieces(0).ref_alloc(), 77u);
  EXPECT_EQ(h.pieces(0).ref_offset(), 4096u);
  EXPECT_EQ(h.pieces(0).ref_row_stride(), 64u);
  EXPECT_EQ(h.pieces(0).ref_rows(), 4u);
  EXPECT_EQ(h.pieces(0).bytes(), 128u);
  EXPECT_EQ(h.pieces(1).ref_alloc(), 0u);
}

// A direct piece whose rows overlap (stride shorter than a row) or do not divide its bytes is data
// loss, named; a payload bound never applies to it.
TEST(Bucket, MalformedDirectPieceIsDataLoss) {
  for (auto [bytes, stride, rows] : {std::tuple<uint64_t, uint64_t, uint64_t>{128, 16, 4}, {130, 64, 4}, {128, 64, 0}}) {
    BucketBuilder b(4096);
    b.reset(1, 0, 0);
    b.add_ref_piece(6, Region{{0, 0}, {4, 16}}, DType::kBF16, bytes, 5, 0, stride, rows);
    auto n = b.seal(false);
    ASSERT_TRUE(n.ok());
    wire::BucketHeader h;
    Status st = decode_bucket(b.data(), *n, &h);
    EXPECT_EQ(st.code(), StatusCode::kDataLoss) << bytes << " " << stride << " " << rows;
    EXPECT_THAT(st.message(), HasSubstr("parameter #6"));
  }
}

}  // namespace
}  // namespace ferry::coordinator

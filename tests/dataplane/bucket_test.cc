#include "dataplane/bucket.h"

#include <cstring>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "dataplane/device_bucket.h"
#include "core/buffer.h"
#include "core/device_copy.h"

namespace ferry::dataplane {
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
}  // namespace ferry::dataplane

namespace ferry::dataplane {
namespace {

// The stepwise decode (trailer, then exactly the header's bytes) agrees with decode_bucket and
// refuses a tail of the wrong length.
TEST(Bucket, StepwiseDecodeReadsOnlyTheTail) {
  Built b = build(true);
  const size_t size = b.bytes.size();
  auto tail = bucket_tail_bytes(b.bytes.data() + size - kBucketTrailerBytes, size);
  ASSERT_TRUE(tail.ok()) << tail.status().to_string();
  ASSERT_GT(*tail, kBucketTrailerBytes);
  ASSERT_EQ(size - *tail, 48u);  // the payload: 32 + 16 bytes
  std::vector<uint8_t> copy(b.bytes.end() - static_cast<std::ptrdiff_t>(*tail), b.bytes.end());
  wire::BucketHeader h;
  ASSERT_TRUE(decode_bucket_header(copy.data(), copy.size(), size, &h).ok());
  EXPECT_EQ(h.pieces_size(), 2);
  EXPECT_EQ(h.payload_bytes(), 48u);
  EXPECT_TRUE(check_payload(h, b.bytes.data(), Device::cpu()).ok());
  b.bytes[40] ^= 1;
  EXPECT_EQ(check_payload(h, b.bytes.data(), Device::cpu()).code(), StatusCode::kDataLoss);
  EXPECT_FALSE(decode_bucket_header(copy.data() + 1, copy.size() - 1, size, &h).ok());
  uint8_t bad[kBucketTrailerBytes] = {0xff, 0xff, 0, 0, 0x46, 0x52, 0x59, 0x42};  // header longer than the bucket
  EXPECT_EQ(bucket_tail_bytes(bad, 64).status().code(), StatusCode::kDataLoss);
}

// A bucket built in device memory (payload copied there by the caller, header and trailer by
// seal()) decodes from the device, its checksum computed from the device bytes; a flipped payload
// byte on the device fails it; PayloadPool keeps a payload and reuses a returned buffer.
TEST(Bucket, DeviceBucketRoundTrip) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  const Device dev = Device::cuda(0);
  BucketBuilder b(1 << 20, dev);
  ASSERT_TRUE(b.ok());
  b.reset(9, 0, 4);
  std::vector<uint8_t> rows(3 * 64);
  for (size_t i = 0; i < rows.size(); ++i) rows[i] = static_cast<uint8_t>(i * 7 + 1);
  // Two rows of 40 bytes out of rows 64 bytes apart, then a contiguous piece.
  uint8_t* p = b.add_piece(1, Region{{0, 0}, {2, 20}}, DType::kBF16, 80);
  ASSERT_TRUE(copy_rows_async(0, p, 40, rows.data() + 8, 64, 40, 2).ok());
  p = b.add_piece(2, Region{{0}, {16}}, DType::kF32, 64);
  ASSERT_TRUE(copy_async(0, p, rows.data() + 128, 64).ok());
  auto n = b.seal(true);
  ASSERT_TRUE(n.ok()) << n.status().to_string();
  wire::BucketHeader h;
  Status st = decode_device_bucket(b.data(), *n, dev, &h);
  ASSERT_TRUE(st.ok()) << st.to_string();
  EXPECT_EQ(h.version(), 9u);
  ASSERT_EQ(h.pieces_size(), 2);
  EXPECT_EQ(h.pieces(1).offset(), 80u);
  std::vector<uint8_t> back(144);
  ASSERT_TRUE(copy_now(0, back.data(), b.data(), back.size()).ok());
  for (size_t i = 0; i < 40; ++i) {
    EXPECT_EQ(back[i], rows[8 + i]) << i;
    EXPECT_EQ(back[40 + i], rows[72 + i]) << i;
  }
  EXPECT_EQ(std::memcmp(back.data() + 80, rows.data() + 128, 64), 0);

  PayloadPool pool;
  const void* first = nullptr;
  {
    auto kept = pool.keep(b.data(), 144, dev, dev);
    ASSERT_TRUE(kept.ok()) << kept.status().to_string();
    first = (*kept)->data();
    std::vector<uint8_t> again(144);
    ASSERT_TRUE(copy_now(0, again.data(), (*kept)->data(), again.size()).ok());
    EXPECT_EQ(again, back);
  }
  EXPECT_EQ(pool.idle(), 1u);
  auto reused = pool.keep(b.data(), 100, dev, dev);
  ASSERT_TRUE(reused.ok());
  EXPECT_EQ((*reused)->data(), first);
  auto on_host = pool.keep(b.data(), 144, dev, Device::cpu());
  ASSERT_TRUE(on_host.ok());
  EXPECT_EQ(std::memcmp((*on_host)->data(), back.data(), 144), 0);

  uint8_t flip = back[5] ^ 0x10;
  ASSERT_TRUE(copy_now(0, b.data() + 5, &flip, 1).ok());
  st = decode_device_bucket(b.data(), *n, dev, &h);
  EXPECT_EQ(st.code(), StatusCode::kDataLoss) << st.to_string();
}

}  // namespace
}  // namespace ferry::dataplane

#if FERRY_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "transport/ipc_share.h"

namespace ferry::dataplane {
namespace {

// Memory of a stream-ordered pool has no legacy IPC handle: the exporter refuses it (the trainer
// then sends those weights as bytes) and leaves no CUDA error behind for the application's next
// check. Regression: PyTorch with expandable segments raised ferry's failed export as its own
// error at the next kernel launch after the first update.
TEST(Bucket, RefusedExportLeavesNoCudaErrorBehind) {
  if (!cuda_device_available()) GTEST_SKIP() << "no CUDA device";
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  void* p = nullptr;
  ASSERT_EQ(cudaMallocAsync(&p, 1 << 20, nullptr), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
  transport::IpcExporter exporter;
  auto ref = exporter.locate(p, 1 << 20);
  EXPECT_FALSE(ref.ok());
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  EXPECT_EQ(cudaFreeAsync(p, nullptr), cudaSuccess);
  EXPECT_EQ(cudaStreamSynchronize(nullptr), cudaSuccess);
}

}  // namespace
}  // namespace ferry::dataplane
#endif

#include "core/safetensors.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "core/buffer.h"

namespace ferry {
namespace {

namespace fs = std::filesystem;

class SafetensorsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    dir_ = fs::temp_directory_path() / ("ferry_st_" + std::to_string(::getpid()) + "_" + info->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  std::string path(const std::string& name) const { return (dir_ / name).string(); }

  // Writes raw bytes: the independent writer used for handwritten and malformed files.
  std::string write_raw(const std::string& name, const std::string& bytes) const {
    const std::string p = path(name);
    std::ofstream(p, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
    return p;
  }

  static std::string le64(uint64_t v) {
    std::string out(8, '\0');
    for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((v >> (8 * i)) & 0xff);
    return out;
  }

  // A file with `header` as its JSON (unpadded) and `data_bytes` bytes of data.
  std::string file_with(const std::string& header, size_t data_bytes) const {
    return write_raw("f.safetensors", le64(header.size()) + header + std::string(data_bytes, '\x5a'));
  }

  static std::string read_all(const std::string& p) {
    std::ifstream in(p, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
  }

  fs::path dir_;
};

std::vector<uint8_t> random_bytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> out(n);
  for (auto& b : out) b = static_cast<uint8_t>(rng());
  return out;
}

// Expects `s` to fail with `code` and a message naming the file and containing `what`.
void expect_error(const Status& s, StatusCode code, const std::string& file, const std::string& what) {
  EXPECT_EQ(s.code(), code) << s.to_string();
  EXPECT_NE(s.message().find(file), std::string::npos) << s.to_string();
  EXPECT_NE(s.message().find(what), std::string::npos) << "missing '" << what << "' in " << s.to_string();
}

TEST_F(SafetensorsTest, RoundTripEveryDType) {
  std::vector<std::vector<uint8_t>> storage;
  std::vector<std::pair<std::string, TensorView>> tensors;
  const Shape shape{3, 4};
  uint32_t seed = 1;
  // U8 first so that a careless layout would leave later tensors misaligned.
  std::vector<DType> dtypes{DType::kU8};
  for (DType dt : kAllDTypes) {
    if (dt != DType::kU8) dtypes.push_back(dt);
  }
  for (DType dt : dtypes) {
    storage.push_back(random_bytes(dtype_bytes(dt, shape_numel(shape)), seed++));
    tensors.emplace_back(std::string("t.") + std::string(dtype_name(dt)), TensorView(storage.back().data(), dt, shape));
  }
  const std::map<std::string, std::string> metadata{{"format", "pt"}, {"step", "42"}};
  const std::string p = path("all.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors, metadata).ok());

  auto reader = SafetensorsReader::open(p);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  EXPECT_EQ(reader->metadata(), metadata);  // ferry's int4 marker is not reported
  EXPECT_EQ(reader->names().size(), tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& [name, want] = tensors[i];
    auto got = reader->tensor(name);
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(got->dtype(), want.dtype()) << name;
    EXPECT_EQ(got->shape(), want.shape()) << name;
    EXPECT_TRUE(got->device().is_cpu());
    EXPECT_TRUE(got->is_contiguous());
    ASSERT_EQ(got->nbytes(), want.nbytes()) << name;
    EXPECT_EQ(std::memcmp(got->data(), want.data(), want.nbytes()), 0) << name;
    const auto align = static_cast<uintptr_t>(std::max(1, dtype_bits(want.dtype()) / 8));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(got->data()) % align, 0u) << name << " is misaligned";
  }
  // File order: largest element first.
  const auto names = reader->names();
  EXPECT_EQ(names.front(), "t.i64");
  EXPECT_EQ(names.back(), "t.i4x2");
}

TEST_F(SafetensorsTest, WritesTheStandardLayout) {
  std::vector<uint8_t> packed = {0x21, 0x43, 0x65, 0x87};
  float f[3] = {1.0f, 2.0f, 3.0f};
  const std::vector<std::pair<std::string, TensorView>> tensors{
      {"w4", TensorView(packed.data(), DType::kI4Packed, {2, 4})},
      {"b", TensorView(f, DType::kF32, {3})},
  };
  const std::string p = path("layout.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors, {{"k", "v"}}).ok());
  const std::string bytes = read_all(p);
  ASSERT_GE(bytes.size(), 8u);
  uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<uint8_t>(bytes[static_cast<size_t>(i)]);
  EXPECT_EQ(n % 8, 0u);
  ASSERT_EQ(bytes.size(), 8 + n + 12 + 4);
  const std::string header = bytes.substr(8, n);
  EXPECT_EQ(header.find_last_not_of(' ') + 1, header.find_last_of('}') + 1);  // padded with spaces only
  const auto j = nlohmann::json::parse(header);
  EXPECT_EQ(j["b"]["dtype"], "F32");
  EXPECT_EQ(j["b"]["shape"], nlohmann::json::array({3}));
  EXPECT_EQ(j["b"]["data_offsets"], nlohmann::json::array({0, 12}));
  EXPECT_EQ(j["w4"]["dtype"], "U8");
  EXPECT_EQ(j["w4"]["shape"], nlohmann::json::array({2, 2}));
  EXPECT_EQ(j["w4"]["data_offsets"], nlohmann::json::array({12, 16}));
  EXPECT_EQ(j["__metadata__"]["k"], "v");
  EXPECT_EQ(j["__metadata__"]["ferry.dtype.w4"], "i4x2");
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n, f, 12), 0);
  EXPECT_EQ(std::memcmp(bytes.data() + 8 + n + 12, packed.data(), 4), 0);
}

TEST_F(SafetensorsTest, ScalarAndEmptyTensors) {
  int64_t scalar = -7;
  const std::vector<std::pair<std::string, TensorView>> tensors{
      {"scalar", TensorView(&scalar, DType::kI64, {})},
      {"empty", TensorView(nullptr, DType::kF16, {0, 5})},
  };
  const std::string p = path("s.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors).ok());
  auto reader = SafetensorsReader::open(p);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  auto s = reader->tensor("scalar");
  ASSERT_TRUE(s.ok());
  EXPECT_EQ(s->shape(), Shape{});
  int64_t got = 0;
  std::memcpy(&got, s->data(), sizeof(got));
  EXPECT_EQ(got, -7);
  auto e = reader->tensor("empty");
  ASSERT_TRUE(e.ok());
  EXPECT_EQ(e->shape(), (Shape{0, 5}));
  EXPECT_EQ(e->numel(), 0);
}

TEST_F(SafetensorsTest, ReadsAHandwrittenFile) {
  // Written as another tool would: no padding, __metadata__ last, tensors not in offset order.
  const std::string header =
      R"({"b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]},)"
      R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"__metadata__":{"format":"pt"}})";
  std::string data;
  for (uint8_t byte : {0x00, 0x00, 0xc0, 0x3f,     // 1.5f
                       0x00, 0x00, 0x00, 0xc0,     // -2.0f
                       0x80, 0x3f, 0x00, 0xc0}) {  // bf16 1.0, -2.0
    data.push_back(static_cast<char>(byte));
  }
  const std::string p = write_raw("hand.safetensors", le64(header.size()) + header + data);
  auto reader = SafetensorsReader::open(p);
  ASSERT_TRUE(reader.ok()) << reader.status().to_string();
  EXPECT_EQ(reader->names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(reader->metadata(), (std::map<std::string, std::string>{{"format", "pt"}}));
  EXPECT_TRUE(reader->contains("a"));
  EXPECT_FALSE(reader->contains("c"));
  auto a = reader->tensor("a");
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(a->dtype(), DType::kF32);
  float af[2];
  std::memcpy(af, a->data(), sizeof(af));
  EXPECT_EQ(af[0], 1.5f);
  EXPECT_EQ(af[1], -2.0f);
  auto b = reader->tensor("b");
  ASSERT_TRUE(b.ok());
  EXPECT_EQ(b->dtype(), DType::kBF16);
  EXPECT_EQ(b->shape(), (Shape{1, 2}));
  uint16_t bb[2];
  std::memcpy(bb, b->data(), sizeof(bb));
  EXPECT_EQ(bb[0], 0x3f80);
  EXPECT_EQ(bb[1], 0xc000);
  auto missing = reader->tensor("c");
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);

  // The views point into the mapping and survive a move of the reader.
  SafetensorsReader moved = std::move(reader).value();
  auto a2 = moved.tensor("a");
  ASSERT_TRUE(a2.ok());
  EXPECT_EQ(a2->data(), a->data());
}

TEST_F(SafetensorsTest, MappingIsReadOnly) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  float f = 1.0f;
  const std::vector<std::pair<std::string, TensorView>> tensors{{"x", TensorView(&f, DType::kF32, {1})}};
  const std::string p = path("ro.safetensors");
  ASSERT_TRUE(write_safetensors(p, tensors).ok());
  auto reader = SafetensorsReader::open(p);
  ASSERT_TRUE(reader.ok());
  auto x = reader->tensor("x");
  ASSERT_TRUE(x.ok());
  EXPECT_DEATH(*static_cast<volatile float*>(x->data()) = 2.0f, "");
}

TEST_F(SafetensorsTest, MissingFileIsNotFound) {
  auto r = SafetensorsReader::open(path("nope.safetensors"));
  expect_error(r.status(), StatusCode::kNotFound, "nope.safetensors", "No such file");
}

TEST_F(SafetensorsTest, FileShorterThanLength) {
  const std::string p = write_raw("short.safetensors", "abc");
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kDataLoss, p, "too short");
}

TEST_F(SafetensorsTest, HeaderLengthTooLarge) {
  const std::string p = write_raw("big.safetensors", le64(uint64_t{1} << 40) + "{}");
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "exceeds the limit");
}

TEST_F(SafetensorsTest, HeaderLengthBeyondFile) {
  const std::string p = write_raw("trunc.safetensors", le64(100) + "{}");
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kDataLoss, p, "runs past the end of the file");
}

TEST_F(SafetensorsTest, InvalidJson) {
  const std::string p = file_with(R"({"a": {"dtype": "F32",)", 0);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "invalid JSON header");
  const std::string q = file_with(R"([1, 2])", 0);
  expect_error(SafetensorsReader::open(q).status(), StatusCode::kInvalidArgument, q, "not a JSON object");
}

TEST_F(SafetensorsTest, OffsetsOutOfRange) {
  const std::string p = file_with(R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kDataLoss, p, "'a': data_offsets [0, 16] run past");
}

TEST_F(SafetensorsTest, OffsetsNotMatchingShape) {
  const std::string p = file_with(R"({"a":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}})", 20);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "'a'");
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "F32[2, 3] needs 24");
  const std::string q = file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[8,4]}})", 8);
  expect_error(SafetensorsReader::open(q).status(), StatusCode::kInvalidArgument, q, "end before they begin");
  const std::string r =
      file_with(R"({"a":{"dtype":"I64","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", 8);
  expect_error(SafetensorsReader::open(r).status(), StatusCode::kInvalidArgument, r, "more than 2^64");
}

TEST_F(SafetensorsTest, OverlappingTensors) {
  const std::string p = file_with(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                  R"("b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
                                  12);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "'a' [0, 8] and 'b' [4, 12] overlap");
}

TEST_F(SafetensorsTest, GapsAndTrailingBytes) {
  const std::string p = file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                                  R"("b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
                                  12);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "unused bytes at [4, 8] before tensor 'b'");
  const std::string q = file_with(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", 6);
  expect_error(SafetensorsReader::open(q).status(), StatusCode::kInvalidArgument, q, "2 unused bytes after the last tensor");
}

TEST_F(SafetensorsTest, UnknownDType) {
  const std::string p = file_with(R"({"a":{"dtype":"F64","shape":[1],"data_offsets":[0,8]}})", 8);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "tensor 'a': unknown dtype 'F64'");
}

TEST_F(SafetensorsTest, DuplicateNames) {
  const std::string p = file_with(R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},)"
                                  R"("a":{"dtype":"U8","shape":[1],"data_offsets":[1,2]}})",
                                  2);
  expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, "duplicate tensor name 'a'");
  const std::string q = file_with(R"({"a":{"dtype":"U8","dtype":"U8","shape":[1],"data_offsets":[0,1]}})", 1);
  expect_error(SafetensorsReader::open(q).status(), StatusCode::kInvalidArgument, q, "duplicate key 'dtype'");
}

TEST_F(SafetensorsTest, MalformedEntries) {
  struct Case {
    std::string header;
    std::string what;
  };
  const Case cases[] = {
      {R"({"a":{"shape":[1],"data_offsets":[0,1]}})", "missing string \"dtype\""},
      {R"({"a":{"dtype":"U8","shape":[-1],"data_offsets":[0,1]}})", "not a non-negative integer"},
      {R"({"a":{"dtype":"U8","shape":[1.5],"data_offsets":[0,1]}})", "not a non-negative integer"},
      {R"({"a":{"dtype":"U8","data_offsets":[0,1]}})", "missing array \"shape\""},
      {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0]}})", "missing \"data_offsets\""},
      {R"({"a":{"dtype":"U8","shape":[1],"data_offsets":[0,"1"]}})", "not non-negative integers"},
      {R"({"a":[1]})", "entry is not an object"},
      {R"({"__metadata__":{"k":1},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "'k' is not a string"},
      {R"({"__metadata__":"x","a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})", "__metadata__ is not an object"},
      {R"({"__metadata__":{"ferry.dtype.b":"i4x2"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
       "no tensor named 'b'"},
      {R"({"__metadata__":{"ferry.dtype.a":"i3"},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
       "unknown ferry dtype 'i3'"},
      {R"({"__metadata__":{"ferry.dtype.a":"i4x2"},"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]}})",
       "expected U8 of rank >= 1"},
  };
  for (const Case& c : cases) {
    const std::string p = file_with(c.header, 1);
    SCOPED_TRACE(c.header);
    expect_error(SafetensorsReader::open(p).status(), StatusCode::kInvalidArgument, p, c.what);
  }
}

TEST_F(SafetensorsTest, WriterRejectsBadInput) {
  float f[6] = {};
  const std::string p = path("bad.safetensors");
  auto check = [&](std::vector<std::pair<std::string, TensorView>> tensors, std::map<std::string, std::string> meta,
                   const std::string& what) {
    const Status s = write_safetensors(p, tensors, meta);
    expect_error(s, StatusCode::kInvalidArgument, p, what);
  };
  check({{"a", TensorView(f, DType::kF32, {2, 3}, {1, 2}, Device::cpu())}}, {}, "must be contiguous");
  check({{"a", TensorView(f, DType::kF32, {1})}, {"a", TensorView(f, DType::kF32, {1})}}, {}, "duplicate tensor name 'a'");
  check({{"", TensorView(f, DType::kF32, {1})}}, {}, "empty tensor name");
  check({{"__metadata__", TensorView(f, DType::kF32, {1})}}, {}, "reserved");
  check({{"a", TensorView(f, DType::kI4Packed, {3})}}, {}, "even last dimension");
  check({{"a", TensorView(f, DType::kF32, {1}, Device::cuda(0))}}, {}, "must be on the CPU");
  check({{"a", TensorView(nullptr, DType::kF32, {1})}}, {}, "null data");
  check({{"a", TensorView(f, DType::kF32, {1})}}, {{"ferry.dtype.a", "i4x2"}}, "reserved for ferry");
  EXPECT_FALSE(fs::exists(p));
  EXPECT_TRUE(fs::is_empty(dir_));
}

TEST_F(SafetensorsTest, WriteReplacesAtomically) {
  const std::string p = path("m.safetensors");
  float one = 1.0f, two = 2.0f;
  ASSERT_TRUE(write_safetensors(p, std::vector<std::pair<std::string, TensorView>>{{"x", TensorView(&one, DType::kF32, {1})}}).ok());
  auto first = SafetensorsReader::open(p);
  ASSERT_TRUE(first.ok());
  // A failing write leaves the old file and no temporary behind.
  const std::vector<std::pair<std::string, TensorView>> bad{{"x", TensorView(&two, DType::kF32, {1})},
                                                            {"x", TensorView(&two, DType::kF32, {1})}};
  EXPECT_FALSE(write_safetensors(p, bad).ok());
  // A successful write replaces the file; a reader of the old file keeps its own mapping.
  ASSERT_TRUE(write_safetensors(p, std::vector<std::pair<std::string, TensorView>>{{"y", TensorView(&two, DType::kF32, {1})}}).ok());
  size_t entries = 0;
  for (const auto& e : fs::directory_iterator(dir_)) {
    ++entries;
    EXPECT_EQ(e.path().filename(), "m.safetensors");
  }
  EXPECT_EQ(entries, 1u);
  auto second = SafetensorsReader::open(p);
  ASSERT_TRUE(second.ok());
  EXPECT_EQ(second->names(), std::vector<std::string>{"y"});
  auto old = first->tensor("x");
  ASSERT_TRUE(old.ok());
  EXPECT_EQ(*static_cast<const float*>(old->data()), 1.0f);
}

TEST_F(SafetensorsTest, WriteIntoMissingDirectoryFails) {
  float f = 0;
  const std::string p = path("no/such/dir/x.safetensors");
  const Status s = write_safetensors(p, std::vector<std::pair<std::string, TensorView>>{{"x", TensorView(&f, DType::kF32, {1})}});
  expect_error(s, StatusCode::kUnavailable, p, "cannot create");
}

TEST(SafetensorsDType, NamesRoundTrip) {
  for (DType dt : kAllDTypes) {
    auto parsed = parse_safetensors_dtype(safetensors_dtype_name(dt));
    ASSERT_TRUE(parsed.ok()) << dtype_name(dt);
    EXPECT_EQ(*parsed, dt == DType::kI4Packed ? DType::kU8 : dt);
  }
  EXPECT_EQ(safetensors_dtype_name(DType::kF8E4M3FN), "F8_E4M3");
  EXPECT_EQ(parse_safetensors_dtype("BOOL").status().code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace ferry

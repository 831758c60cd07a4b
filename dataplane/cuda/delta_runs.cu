// The runs encoding on the device (dataplane/delta_device.h): found from a compare's bitmap at the
// trainer (find_runs), and decoded at a rank (apply_runs).
//
// find_runs: each 64-bit word of the bitmap (bits past n masked) marks where runs start (a set bit
// after a clear one, the word before's last bit carried in) and end (a set bit before a clear one);
// a block scan of the starts gives each run its index (the run open into a word ends at the index
// before), each run's pair of varints its size, a second scan their places; the host reads the
// pairs' size and, only when the encoding would be chosen, the pairs are written.
//
// apply_runs: the host found where the pairs end (by counting the bytes that end varints); here, in
// stream order:
//   1. each block counts the bytes of the pairs that end a varint, a one-block launch turns the
//      counts into offsets, and each byte that ends one decodes it (the bytes back to the
//      previous end, 10 at most, as the host's get_varint reads them) into its place: even
//      places skips, odd ones lengths;
//   2. the runs' ends (each run's skip and length summed over it and the runs before, saturating
//      past the piece) in the same three launches over the pairs;
//   3. the host reads whether any check failed and where the last run ends; only then
//   4. each 64-bit word of the bitmap takes the bits of the runs that cross it (a binary search
//      for the first), and apply_bitmap writes the values, once their count is the bitmap's.
#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "core/cuda_check.h"
#include "dataplane/cuda/delta_blocks.cuh"
#include "dataplane/delta.h"
#include "dataplane/delta_device.h"

namespace ferry::dataplane::detail {
namespace {

constexpr uint32_t kTooLong = 1, kEmptyRun = 2, kPastPiece = 4;

// 1 for a byte that ends a varint.
struct VarintEnds {
  const uint8_t* pairs;
  __device__ uint32_t operator()(uint64_t i) const { return pairs[i] < 0x80 ? 1u : 0u; }
};

__global__ void decode_varints(const uint8_t* pairs, uint64_t bytes, const uint64_t* offsets, uint64_t count,
                               uint64_t n, uint64_t* values, uint32_t* bad) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  const bool ends = i < bytes && pairs[i] < 0x80;
  uint32_t total = 0;
  const uint64_t index = offsets[blockIdx.x] + block_exclusive(ends ? 1u : 0u, &total);
  if (!ends || index >= count) return;
  uint64_t first = i;
  while (first > 0 && pairs[first - 1] >= 0x80 && i - first < 9) --first;
  if (first > 0 && pairs[first - 1] >= 0x80) {  // more than 10 bytes
    atomicOr(bad, kTooLong);
    return;
  }
  uint64_t x = 0;
  for (uint64_t j = first; j <= i; ++j) x |= static_cast<uint64_t>(pairs[j] & 0x7f) << (7 * (j - first));
  values[index] = x;
  if (index % 2 == 1 && x == 0) atomicOr(bad, kEmptyRun);
  if (x > n) atomicOr(bad, kPastPiece);
}

// Run i's skip and length summed, saturating at `cap`.
struct Spans {
  const uint64_t* values;
  uint64_t cap;
  __device__ uint64_t operator()(uint64_t i) const { return sat_add(values[2 * i], values[2 * i + 1], cap); }
};

// Run i's length (its pair's second varint).
struct Lengths {
  const uint64_t* values;
  __device__ uint64_t operator()(uint64_t i) const { return values[2 * i + 1]; }
};

// The decoder's checks gathered for one read: its flags, the last run's end, the varints counted,
// the pairs' last byte, and the elements the runs cover.
__global__ void gather_checks(const uint32_t* flags, const uint64_t* last_end, const uint64_t* varints,
                              const uint8_t* final_byte, const uint64_t* covered, uint64_t* out) {
  out[0] = *flags;
  out[1] = *last_end;
  out[2] = *varints;
  out[3] = *final_byte;
  out[4] = *covered;
}

__global__ void run_ends(Spans spans, uint64_t r, const uint64_t* offsets, uint64_t* ends) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  uint64_t total = 0;
  const uint64_t inc = block_inclusive<uint64_t>(i < r ? spans(i) : 0, spans.cap, &total);
  if (i < r) ends[i] = sat_add(offsets[blockIdx.x], inc, spans.cap);
}

// Word w of the bitmap: the bits of the runs that cross elements [64 w, 64 w + 64). The runs are
// checked: each at least one element, ends strictly rising.
__global__ void runs_to_bitmap(const uint64_t* ends, const uint64_t* values, uint64_t r, uint64_t words,
                               uint64_t* bitmap) {
  const uint64_t w = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  if (w >= words) return;
  const uint64_t lo = w * 64, hi = lo + 64;
  uint64_t a = 0, b = r;  // the first run that ends past lo
  while (a < b) {
    const uint64_t m = a + (b - a) / 2;
    if (ends[m] <= lo) {
      a = m + 1;
    } else {
      b = m;
    }
  }
  uint64_t word = 0;
  for (uint64_t i = a; i < r; ++i) {
    const uint64_t end = ends[i], start = end - values[2 * i + 1];
    if (start >= hi) break;
    const uint64_t s = start > lo ? start : lo, e = end < hi ? end : hi;
    const uint64_t width = e - s;
    word |= (width == 64 ? ~uint64_t{0} : (uint64_t{1} << width) - 1) << (s - lo);
  }
  bitmap[w] = word;
}

__device__ __forceinline__ uint32_t varint_size(uint64_t v) {
  uint32_t n = 1;
  for (; v >= 0x80; v >>= 7) ++n;
  return n;
}

// The bitmap's 64-bit words, bits past n clear (the scan leaves the last word's tail unwritten).
struct Words {
  const uint64_t* bitmap;
  uint64_t n, words;
  __device__ uint64_t word(uint64_t w) const {
    uint64_t x = bitmap[w];
    const uint64_t keep = n - w * 64;
    if (keep < 64) x &= (uint64_t{1} << keep) - 1;
    return x;
  }
  __device__ uint64_t starts(uint64_t w) const {
    const uint64_t x = word(w), carry = w > 0 ? word(w - 1) >> 63 : 0;
    return x & ~((x << 1) | carry);
  }
  __device__ uint64_t lasts(uint64_t w) const {
    const uint64_t x = word(w), next = w + 1 < words ? word(w + 1) & 1 : 0;
    return x & ~((x >> 1) | (next << 63));
  }
  __device__ uint32_t operator()(uint64_t w) const { return static_cast<uint32_t>(__popcll(starts(w))); }
};

// Each run's first element and the element past its last, in order.
__global__ void list_runs(Words words, const uint64_t* offsets, uint64_t* firsts, uint64_t* ends) {
  const uint64_t w = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  const uint64_t s = w < words.words ? words.starts(w) : 0;
  uint32_t total = 0;
  const uint64_t base = offsets[blockIdx.x] + block_exclusive(static_cast<uint32_t>(__popcll(s)), &total);
  if (w >= words.words) return;
  uint64_t i = base;
  for (uint64_t m = s; m != 0; m &= m - 1) firsts[i++] = w * 64 + static_cast<uint64_t>(__ffsll(m) - 1);
  // A run open into this word (the last bit of the word before and its first bit set) ends here or
  // later, as the run before this word's first start.
  i = base - ((w > 0 ? words.word(w - 1) >> 63 : 0) & words.word(w));
  for (uint64_t m = words.lasts(w); m != 0; m &= m - 1) ends[i++] = w * 64 + static_cast<uint64_t>(__ffsll(m));
}

// Run i's pair: the elements left as they are since the run before, and its length.
struct Pair {
  uint64_t* firsts;
  uint64_t* ends;
  __device__ uint64_t skip(uint64_t i) const { return firsts[i] - (i > 0 ? ends[i - 1] : 0); }
  __device__ uint64_t length(uint64_t i) const { return ends[i] - firsts[i]; }
  __device__ uint32_t operator()(uint64_t i) const { return varint_size(skip(i)) + varint_size(length(i)); }
};

__device__ __forceinline__ uint8_t* put_varint(uint8_t* w, uint64_t v) {
  for (; v >= 0x80; v >>= 7) *w++ = static_cast<uint8_t>(v | 0x80);
  *w++ = static_cast<uint8_t>(v);
  return w;
}

__global__ void write_pairs(Pair pair, uint64_t r, const uint64_t* offsets, uint8_t* out) {
  const uint64_t i = static_cast<uint64_t>(blockIdx.x) * kScanThreads + threadIdx.x;
  uint32_t total = 0;
  const uint64_t at = offsets[blockIdx.x] + block_exclusive(i < r ? pair(i) : 0u, &total);
  if (i < r) put_varint(put_varint(out + at, pair.skip(i)), pair.length(i));
}

}  // namespace

Status apply_runs(int device, void* dst, uint64_t n, size_t elem, const uint8_t* pairs, uint64_t pair_bytes, uint64_t r,
                  const void* values, uint64_t k, bool xor_values, const RowMarks* rows) {
  if (r == 0) {
    if (k != 0) return Status::data_loss("delta piece: no runs, " + std::to_string(k) + " values");
    return ok_status();
  }
  if (n >= (uint64_t{1} << 62)) return Status::invalid_argument("device deltas: piece too large");
  if (pair_bytes / 2 < r) {
    return Status::data_loss("delta piece: " + std::to_string(r) + " runs in " + std::to_string(pair_bytes) + " bytes");
  }
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  const cudaStream_t st = nullptr;  // the legacy default stream, as apply_bitmap's
  uint64_t byte_blocks = 0, run_blocks = 0, word_blocks = 0;
  const uint64_t words = (n + 63) / 64;
  FERRY_RETURN_IF_ERROR(blocks_for(pair_bytes, &byte_blocks));
  FERRY_RETURN_IF_ERROR(blocks_for(r, &run_blocks));
  FERRY_RETURN_IF_ERROR(blocks_for(words, &word_blocks));
  // The decoded varints (2r), the runs' ends (r), the bitmap (words), the checks' flags, the checks
  // gathered (5).
  DeviceScratch work;
  FERRY_RETURN_IF_ERROR(work.allocate((3 * r + words + 1 + 5) * sizeof(uint64_t), st));
  auto* decoded = static_cast<uint64_t*>(work.p);
  uint64_t* ends = decoded + 2 * r;
  uint64_t* bitmap = ends + r;
  auto* bad = reinterpret_cast<uint32_t*>(bitmap + words);
  uint64_t* gathered = bitmap + words + 1;
  FERRY_CUDA_CHECK(cudaMemsetAsync(bad, 0, sizeof(uint32_t), st));
  Offsets<uint32_t> at_varint;
  FERRY_RETURN_IF_ERROR(
      block_offsets_of<uint32_t>(VarintEnds{pairs}, pair_bytes, byte_blocks, UINT32_MAX, st, at_varint));
  decode_varints<<<static_cast<unsigned>(byte_blocks), kScanThreads, 0, st>>>(pairs, pair_bytes, at_varint.offsets,
                                                                              2 * r, n, decoded, bad);
  FERRY_CUDA_LAUNCH_CHECK();
  const Spans spans{decoded, n + 1};
  Offsets<uint64_t> at_run;
  FERRY_RETURN_IF_ERROR(block_offsets_of<uint64_t>(spans, r, run_blocks, n + 1, st, at_run));
  run_ends<<<static_cast<unsigned>(run_blocks), kScanThreads, 0, st>>>(spans, r, at_run.offsets, ends);
  FERRY_CUDA_LAUNCH_CHECK();
  // Checked before anything is written, in one read: no flag, the runs ending within the piece, 2r
  // varints with the pairs ending at the last one's end, and as many elements covered as values
  // follow (the runs are disjoint once the rest holds, so the bitmap marks that many).
  Offsets<uint64_t> covered;
  FERRY_RETURN_IF_ERROR(block_offsets_of<uint64_t>(Lengths{decoded}, r, run_blocks, n + 1, st, covered));
  gather_checks<<<1, 1, 0, st>>>(bad, ends + r - 1, at_varint.offsets + byte_blocks, pairs + pair_bytes - 1,
                                 covered.offsets + run_blocks, gathered);
  FERRY_CUDA_LAUNCH_CHECK();
  uint64_t checks[5] = {};
  FERRY_CUDA_CHECK(cudaMemcpyAsync(checks, gathered, sizeof checks, cudaMemcpyDeviceToHost, st));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  const uint64_t flags = checks[0], last = checks[1], varints = checks[2], final_byte = checks[3], marked = checks[4];
  if (flags != 0 || last > n || varints != 2 * r || final_byte >= 0x80 || marked != k) {
    return Status::data_loss("delta piece: runs refused on the device (flags " + std::to_string(flags) + ", " +
                             std::to_string(varints) + " varints for " + std::to_string(r) +
                             " runs, the last ending at " + std::to_string(last) + " of " + std::to_string(n) +
                             (final_byte >= 0x80 ? ", pairs ending inside a varint" : "") + ", covering " +
                             std::to_string(marked) + " elements for " + std::to_string(k) + " values)");
  }
  runs_to_bitmap<<<static_cast<unsigned>(word_blocks), kScanThreads, 0, st>>>(ends, decoded, r, words, bitmap);
  FERRY_CUDA_LAUNCH_CHECK();
  return apply_bitmap(device, dst, n, elem, reinterpret_cast<const uint8_t*>(bitmap), values, xor_values, rows);
}

Status find_runs(int device, const uint8_t* bitmap, uint64_t n, uint64_t limit, uint8_t* pairs, DeviceRuns* found) {
  *found = DeviceRuns{};
  if (n == 0) {
    found->written = limit >= 1;
    return ok_status();
  }
  if (reinterpret_cast<uintptr_t>(bitmap) % 8 != 0) {
    return Status::invalid_argument("device deltas: a bitmap not aligned to 8 bytes");
  }
  const ScopedDevice on(device);
  if (!on.ok()) return Status::internal("device deltas: cuda:" + std::to_string(device) + " could not be made current");
  const cudaStream_t st = nullptr;  // the legacy default stream, after the compare that wrote the bitmap
  const Words words{reinterpret_cast<const uint64_t*>(bitmap), n, (n + 63) / 64};
  uint64_t word_blocks = 0;
  FERRY_RETURN_IF_ERROR(blocks_for(words.words, &word_blocks));
  Offsets<uint32_t> at_run;
  FERRY_RETURN_IF_ERROR(block_offsets_of<uint32_t>(words, words.words, word_blocks, UINT32_MAX, st, at_run));
  uint64_t r = 0;
  FERRY_CUDA_CHECK(cudaMemcpyAsync(&r, at_run.offsets + word_blocks, sizeof(r), cudaMemcpyDeviceToHost, st));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  found->runs = r;
  if (r == 0) {
    found->written = limit >= 1;  // the count's one byte
    return ok_status();
  }
  const size_t count_bytes = varint_bytes(r);
  if (count_bytes + 2 * r > limit) return ok_status();  // each pair takes two bytes at least: not written
  uint64_t run_blocks = 0;
  FERRY_RETURN_IF_ERROR(blocks_for(r, &run_blocks));
  DeviceScratch runs;
  FERRY_RETURN_IF_ERROR(runs.allocate(2 * r * sizeof(uint64_t), st));
  const Pair pair{static_cast<uint64_t*>(runs.p), static_cast<uint64_t*>(runs.p) + r};
  list_runs<<<static_cast<unsigned>(word_blocks), kScanThreads, 0, st>>>(words, at_run.offsets, pair.firsts, pair.ends);
  FERRY_CUDA_LAUNCH_CHECK();
  Offsets<uint32_t> at_byte;
  FERRY_RETURN_IF_ERROR(block_offsets_of<uint32_t>(pair, r, run_blocks, UINT32_MAX, st, at_byte));
  uint64_t bytes = 0;
  FERRY_CUDA_CHECK(cudaMemcpyAsync(&bytes, at_byte.offsets + run_blocks, sizeof(bytes), cudaMemcpyDeviceToHost, st));
  FERRY_CUDA_CHECK(cudaStreamSynchronize(st));
  found->pair_bytes = bytes;
  if (count_bytes + bytes > limit) return ok_status();
  write_pairs<<<static_cast<unsigned>(run_blocks), kScanThreads, 0, st>>>(pair, r, at_byte.offsets, pairs);
  FERRY_CUDA_LAUNCH_CHECK();
  found->written = true;  // in order on the legacy stream, before whatever reads them there
  return ok_status();
}

}  // namespace ferry::dataplane::detail

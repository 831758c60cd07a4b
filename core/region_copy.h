// Copies between a box of a contiguous tensor (on the host; on a device below) and a packed (row-major, contiguous)
// buffer. Used to cut pieces out of source tensors and to place them into staging.
#pragma once

#include <cstdint>

#include "core/tensor.h"

namespace ferry {

// Packs the elements of `region` of `tensor` (contiguous, host, whole-byte dtype) into `out`, which
// must hold region.numel() elements.
Status pack_region(const TensorView& tensor, const Region& region, void* out, size_t out_bytes);
// The inverse: scatters `in` (region.numel() packed elements) into `region` of `tensor`.
Status unpack_region(const TensorView& tensor, const Region& region, const void* in, size_t in_bytes);

// Where `region` of a contiguous host tensor lies when it is one run of memory (whole rows of a
// row-major tensor, say): its first byte; else null, and the caller packs it.
const uint8_t* region_span(const TensorView& tensor, const Region& region);
// region_span() for a tensor on any device: the run's first byte in that device's memory.
const uint8_t* region_span_anywhere(const TensorView& tensor, const Region& region);

// pack_region() and unpack_region() for a contiguous tensor in device memory, the packed buffer on
// the host or a device: strided copies on this thread's stream of the tensor's device, complete on
// return.
Status pack_region_on_device(const TensorView& tensor, const Region& region, void* out, size_t out_bytes);
Status unpack_region_on_device(const TensorView& tensor, const Region& region, const void* in, size_t in_bytes);

}  // namespace ferry

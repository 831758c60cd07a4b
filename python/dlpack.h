// The DLPack ABI (https://github.com/dmlc/dlpack, legacy unversioned exchange), declared here so that
// ferry needs no dlpack package and no framework at build time. Only the layout matters: these
// structs are what torch, numpy, cupy and jax hand over inside a "dltensor" PyCapsule.
#pragma once

#include <cstdint>

namespace ferry::python {

enum DLDeviceTypeCode : int32_t {
  kDLCPU = 1,
  kDLCUDA = 2,
  kDLCUDAHost = 3,  // page-locked host memory: readable from the host like any host memory
  kDLCUDAManaged = 13,
};

enum DLDataTypeCode : uint8_t {
  kDLInt = 0,
  kDLUInt = 1,
  kDLFloat = 2,
  kDLBfloat = 4,
  kDLBool = 6,
  kDLFloat8_e4m3fn = 10,
  kDLFloat8_e5m2 = 12,
};

struct DLDevice {
  int32_t device_type;  // DLDeviceTypeCode
  int32_t device_id;
};

struct DLDataType {
  uint8_t code;  // DLDataTypeCode
  uint8_t bits;
  uint16_t lanes;
};

struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; nullptr means compact row-major
  uint64_t byte_offset;
};

struct DLManagedTensor {
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor* self);
};

inline constexpr const char* kDLTensorCapsule = "dltensor";
inline constexpr const char* kUsedDLTensorCapsule = "used_dltensor";

}  // namespace ferry::python

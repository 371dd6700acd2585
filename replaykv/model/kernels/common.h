// What the native kernels share: shape helpers (a kernel takes [..., trailing dims] tensors and
// works on the leading dimensions as one row axis, no reshape dispatches on the Python side) and
// the 16-float vector type with its unaligned load and store.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <cstring>
#include <vector>

namespace replaykv {

// 16 floats side by side (GCC / Clang vector extension: elementwise IEEE operations, one or more
// machine vectors wide); loads and stores take any float address.
constexpr int64_t kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

inline Lanes load(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

inline void check_float_cpu(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, ": expected float32");
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
}

// t is a float32 CPU tensor of `dims` dimensions.
inline void check_dims(const torch::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims, name, ": expected ", dims, " dimensions, got ", t.dim());
  check_float_cpu(t, name);
}

// The sizes of t without its last `trailing` dimensions (t must have at least that many).
inline std::vector<int64_t> lead_shape(const torch::Tensor& t, int64_t trailing, const char* name) {
  TORCH_CHECK(t.dim() >= trailing, name, ": expected at least ", trailing, " dimensions, got ", t.dim());
  return std::vector<int64_t>(t.sizes().begin(), t.sizes().end() - trailing);
}

inline int64_t count(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  return n;
}

// shape followed by the trailing sizes
inline std::vector<int64_t> with(std::vector<int64_t> shape, std::initializer_list<int64_t> trailing) {
  shape.insert(shape.end(), trailing.begin(), trailing.end());
  return shape;
}

// t is a float32 CPU tensor of shape lead + trailing.
inline void expect(const torch::Tensor& t, const std::vector<int64_t>& lead, std::initializer_list<int64_t> trailing,
                   const char* name) {
  check_float_cpu(t, name);
  TORCH_CHECK(t.sizes().vec() == with(lead, trailing), name, ": shape ", t.sizes(), " does not match the other operands");
}

}  // namespace replaykv

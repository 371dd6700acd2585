// Row operations of the model for inference: RMS norm and rotary embedding, one call each.
//
// rms_norm: y[r, c] = x[r, c] / sqrt(mean_c(x[r, :]^2) + eps) * w[c] (w optional)
// rope:     the trailing `rd` channels of each head rotated in pairs,
//           (x0, x1) -> (x0 * cos0 + x1 * sin0, x1 * cos1 + x0 * sin1)
//           with the table's signed sin (-s, s) (negated for the inverse rotation).
//
// torch runs an RMS norm as several kernels and a rotation as a gather, two products, a sum and a
// concatenation: a decode step pays a dispatch for each, dozens of times. Here each row is one
// loop. The sum of squares runs in 16 interleaved partial sums added in a fixed order, so a row's
// value depends on nothing but the row (a decode row equals its prefill row); against torch's
// kernels values may differ by an ulp or so.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace {

using replaykv::kLanes;
using replaykv::Lanes;
using replaykv::load;

constexpr int64_t kGrainElements = 1 << 16;  // elements a thread takes at least

int64_t grain(int64_t row) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row)); }

// sum of x[0..d)^2: 16 partial sums over whole runs of 16, added lane by lane, then the tail.
float sum_squares(const float* x, int64_t d) {
  Lanes acc = {};
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) {
    const Lanes v = load(x + c);
    acc += v * v;
  }
  float total = acc[0];
  for (int64_t g = 1; g < kLanes; ++g) total += acc[g];
  for (; c < d; ++c) total += x[c] * x[c];
  return total;
}

}  // namespace

// x [..., D], weight [D] or an empty tensor -> [..., D]
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  replaykv::check_float_cpu(x, "rms_norm x");
  const int64_t rows = replaykv::count(replaykv::lead_shape(x, 1, "rms_norm x")), d = x.size(-1);
  const bool weighted = weight.numel() > 0;
  if (weighted) {
    replaykv::check_float_cpu(weight, "rms_norm weight");
    TORCH_CHECK(weight.dim() == 1 && weight.size(0) == d, "rms_norm: weight must be [D]");
    weight = weight.contiguous();
  }
  x = x.contiguous();
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* wp = weighted ? weight.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  const float e = static_cast<float>(eps);
  at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict xr = xp + r * d;
      float* __restrict yr = yp + r * d;
      const float inv = 1.0f / std::sqrt(sum_squares(xr, d) / static_cast<float>(d) + e);
      if (wp != nullptr) {
        for (int64_t c = 0; c < d; ++c) yr[c] = (xr[c] * inv) * wp[c];
      } else {
        for (int64_t c = 0; c < d; ++c) yr[c] = xr[c] * inv;
      }
    }
  });
  return y;
}

// x [..., D] read as [R, heads, D]; cos and sin [..., rd] read as [R, rd] (rd even, <= D) -> x's
// shape
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, bool inverse) {
  replaykv::check_float_cpu(x, "rope x");
  replaykv::check_float_cpu(cos, "rope cos");
  replaykv::check_float_cpu(sin, "rope sin");
  TORCH_CHECK(x.dim() >= 1 && cos.dim() >= 1 && sin.sizes() == cos.sizes() && heads >= 1, "rope: bad shapes");
  const int64_t d = x.size(-1), rd = cos.size(-1), rows = cos.numel() / std::max<int64_t>(1, rd);
  TORCH_CHECK(rows * heads * d == x.numel() && rd % 2 == 0 && rd <= d, "rope: tables do not match x");
  x = x.contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  auto y = torch::empty_like(x);
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const float sign = inverse ? -1.0f : 1.0f;
  const int64_t keep = d - rd;
  at::parallel_for(0, rows, grain(heads * d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* __restrict cr = cp + r * rd;
      const float* __restrict sr = sp + r * rd;
      for (int64_t h = 0; h < heads; ++h) {
        const float* __restrict xr = xp + (r * heads + h) * d;
        float* __restrict yr = yp + (r * heads + h) * d;
        for (int64_t c = 0; c < keep; ++c) yr[c] = xr[c];
        const float* __restrict t = xr + keep;
        float* __restrict o = yr + keep;
        for (int64_t c = 0; c < rd; c += 2) {
          o[c] = t[c] * cr[c] + t[c + 1] * (sign * sr[c]);
          o[c + 1] = t[c + 1] * cr[c + 1] + t[c] * (sign * sr[c + 1]);
        }
      }
    }
  });
  return y;
}

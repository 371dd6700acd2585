// The mHC sites' stream collapse and expand for inference, one pass over the streams each.
//
// collapse: x[t, d] = sum_k pre[t, k] * s[t, k, d]
// expand:   new[t, k, d] = post[t, k] * out[t, d] + sum_j comb[t, j, k] * s[t, j, d]
//
// torch computes these as a broadcast product and a sum (collapse) or a product, a batched
// [n, n] x [n, D] matrix product and a sum (expand): several passes over [T, n, D] tensors that
// are several times the size of the cache at long context. Here each token's result is one loop
// over its streams, the sums over k and j in index order, so a token's value depends on nothing
// but its own operands (a decode row equals its prefill row). The rounding may differ from
// torch's by an ulp or so.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

// Elements of [T, n, D] a thread takes at least: a smaller call runs on the calling thread alone
// (a parallel region costs more than a few hundred tokens' streams take to sum).
constexpr int64_t kGrainElements = 1 << 20;

int64_t grain(int64_t n, int64_t d) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n * d)); }

}  // namespace

// s [..., n, D], pre [..., n] -> [..., D]
torch::Tensor hc_collapse(torch::Tensor s, torch::Tensor pre) {
  replaykv::check_float_cpu(s, "hc_collapse streams");
  const auto lead = replaykv::lead_shape(s, 2, "hc_collapse streams");
  const int64_t t_len = replaykv::count(lead), n = s.size(-2), d = s.size(-1);
  replaykv::expect(pre, lead, {n}, "hc_collapse pre");
  s = s.contiguous();
  pre = pre.contiguous();
  auto x = torch::empty(replaykv::with(lead, {d}), s.options());
  const float* sp = s.data_ptr<float>();
  const float* pp = pre.data_ptr<float>();
  float* xp = x.data_ptr<float>();
  at::parallel_for(0, t_len, grain(n, d), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict st = sp + t * n * d;
      const float* __restrict pt = pp + t * n;
      float* __restrict xt = xp + t * d;
      for (int64_t c = 0; c < d; ++c) xt[c] = pt[0] * st[c];
      for (int64_t k = 1; k < n; ++k) {
        const float w = pt[k];
        const float* __restrict sk = st + k * d;
        for (int64_t c = 0; c < d; ++c) xt[c] += w * sk[c];
      }
    }
  });
  return x;
}

// s [..., n, D], out [..., D], post [..., n], comb [..., n, n] -> [..., n, D]
torch::Tensor hc_expand(torch::Tensor s, torch::Tensor out, torch::Tensor post, torch::Tensor comb) {
  replaykv::check_float_cpu(s, "hc_expand streams");
  const auto lead = replaykv::lead_shape(s, 2, "hc_expand streams");
  const int64_t t_len = replaykv::count(lead), n = s.size(-2), d = s.size(-1);
  replaykv::expect(out, lead, {d}, "hc_expand out");
  replaykv::expect(post, lead, {n}, "hc_expand post");
  replaykv::expect(comb, lead, {n, n}, "hc_expand comb");
  s = s.contiguous();
  out = out.contiguous();
  post = post.contiguous();
  comb = comb.contiguous();
  auto y = torch::empty(s.sizes(), s.options());
  const float* sp = s.data_ptr<float>();
  const float* op = out.data_ptr<float>();
  const float* pp = post.data_ptr<float>();
  const float* cp = comb.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, t_len, grain(n, d), [&](int64_t begin, int64_t end) {
    std::vector<float> mix(d);
    for (int64_t t = begin; t < end; ++t) {
      const float* __restrict st = sp + t * n * d;
      const float* __restrict ot = op + t * d;
      const float* __restrict ct = cp + t * n * n;
      for (int64_t k = 0; k < n; ++k) {
        float* __restrict m = mix.data();
        const float c0 = ct[k];  // comb[t, 0, k]
        for (int64_t c = 0; c < d; ++c) m[c] = c0 * st[c];
        for (int64_t j = 1; j < n; ++j) {
          const float cj = ct[j * n + k];
          const float* __restrict sj = st + j * d;
          for (int64_t c = 0; c < d; ++c) m[c] += cj * sj[c];
        }
        const float pk = pp[t * n + k];
        float* __restrict yk = yp + (t * n + k) * d;
        for (int64_t c = 0; c < d; ++c) yk[c] = pk * ot[c] + m[c];
      }
    }
  });
  return y;
}

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

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

void check(const torch::Tensor& t, int64_t dims, const char* name) {
  TORCH_CHECK(t.dim() == dims, name, ": expected ", dims, " dimensions, got ", t.dim());
  TORCH_CHECK(t.scalar_type() == torch::kFloat, name, ": expected float32");
  TORCH_CHECK(t.device().is_cpu(), name, ": expected a CPU tensor");
}

// Elements of [T, n, D] a thread takes at least: a smaller call runs on the calling thread alone
// (a parallel region costs more than a few hundred tokens' streams take to sum).
constexpr int64_t kGrainElements = 1 << 20;

int64_t grain(int64_t n, int64_t d) { return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, n * d)); }

}  // namespace

// s [T, n, D], pre [T, n] -> [T, D]
torch::Tensor hc_collapse(torch::Tensor s, torch::Tensor pre) {
  check(s, 3, "hc_collapse streams");
  check(pre, 2, "hc_collapse pre");
  const int64_t t_len = s.size(0), n = s.size(1), d = s.size(2);
  TORCH_CHECK(pre.size(0) == t_len && pre.size(1) == n, "hc_collapse: pre does not match the streams");
  s = s.contiguous();
  pre = pre.contiguous();
  auto x = torch::empty({t_len, d}, s.options());
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

// s [T, n, D], out [T, D], post [T, n], comb [T, n, n] -> [T, n, D]
torch::Tensor hc_expand(torch::Tensor s, torch::Tensor out, torch::Tensor post, torch::Tensor comb) {
  check(s, 3, "hc_expand streams");
  check(out, 2, "hc_expand out");
  check(post, 2, "hc_expand post");
  check(comb, 3, "hc_expand comb");
  const int64_t t_len = s.size(0), n = s.size(1), d = s.size(2);
  TORCH_CHECK(out.size(0) == t_len && out.size(1) == d, "hc_expand: out does not match the streams");
  TORCH_CHECK(post.size(0) == t_len && post.size(1) == n, "hc_expand: post does not match the streams");
  TORCH_CHECK(comb.size(0) == t_len && comb.size(1) == n && comb.size(2) == n,
              "hc_expand: comb does not match the streams");
  s = s.contiguous();
  out = out.contiguous();
  post = post.contiguous();
  comb = comb.contiguous();
  auto y = torch::empty({t_len, n, d}, s.options());
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

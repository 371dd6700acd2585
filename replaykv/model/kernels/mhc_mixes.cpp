// The mHC sites' mixes for inference, one pass over each token's streams.
//
// For a token's streams x = s[t] (n * D floats, flattened) and the site's weights fn [M, n * D]
// (M = (2 + n) * n), scale [M] and base [M]:
//
//   r = 1 / sqrt(mean(x * x) + norm_eps)                       (the unweighted RMS norm)
//   z_i = (x . fn_i) * r * scale_i + base_i
//   pre_k  = sigmoid(z_k) + hc_eps,  post_k = 2 * sigmoid(z_{n+k})
//   comb   = softmax over each row of z_{2n..} as [n, n], + hc_eps, then Sinkhorn: columns
//            normalised once, then rows and columns iters - 1 times, each by its sum + hc_eps.
//
// torch computes this as a dozen operations (an RMS norm, a padded matrix product, sigmoids, a
// softmax) and a Sinkhorn of 2 * iters - 1 normalisations: about 200 us for a decode token, and
// passes over [T, n * D] and [T, n, n] tensors in prefill. Here every token's values come from its
// own operands in a fixed order: each z_i is one chain of multiply-adds over the n * D inputs in
// index order, every sum runs in index order and the exponentials are the C library's scalar
// ones. Tokens go through in blocks of 16, each operation vectorised across the block's tokens
// (the last block padded with copies of its last token), so every token takes the same
// instructions whatever its neighbours. A decode row therefore equals its prefill row;
// against torch's operations the values may differ by a few ulps.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>

namespace {

constexpr int64_t kBlock = replaykv::kLanes;  // tokens a block computes side by side (one lane each)
constexpr int64_t kGrainBlocks = 4;  // a call of fewer blocks runs on the calling thread
constexpr int64_t kChunk = 8;        // outputs whose accumulators stay in registers

using replaykv::Lanes;  // one float per token of a block

struct Site {
  const float* w_t;    // fn transposed [K, M]
  const float* scale;  // [M]
  const float* base;   // [M]
  int64_t n, k_len, m, iters;
  float norm_eps, hc_eps;
};

float sigmoid(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Normalise comb [n][n] (a token per lane) along columns (by_rows false: comb[j][k] divided by
// sum_j + eps) or rows (by sum_k + eps); sums in index order.
void normalise(Lanes* comb, int64_t n, float eps, bool by_rows) {
  for (int64_t a = 0; a < n; ++a) {  // a: the column (by columns) or the row (by rows)
    auto at = [&](int64_t b) -> Lanes& { return comb[by_rows ? a * n + b : b * n + a]; };
    Lanes acc = at(0);
    for (int64_t b = 1; b < n; ++b) acc += at(b);
    acc += eps;
    for (int64_t b = 0; b < n; ++b) at(b) /= acc;
  }
}

// The mixes of tokens t0 .. t0 + kBlock - 1 (lanes past t_len hold copies of the last token and
// are not written back). x [K] and z [M] are the block's scratch, comb [n * n].
void block(const Site& site, const float* sp, int64_t t0, int64_t t_len, Lanes* x, Lanes* z, Lanes* comb,
           float* pre, float* post, float* comb_out) {
  const int64_t n = site.n, k_len = site.k_len, m = site.m;
  for (int64_t g = 0; g < kBlock; ++g) {
    const float* src = sp + std::min(t0 + g, t_len - 1) * k_len;
    for (int64_t c = 0; c < k_len; ++c) x[c][g] = src[c];
  }
  Lanes sq = {};
  for (int64_t c = 0; c < k_len; ++c) sq += x[c] * x[c];
  // z_i = sum_c x_c * w[c][i] in c order; kChunk outputs at a time in registers.
  int64_t i0 = 0;
  for (; i0 + kChunk <= m; i0 += kChunk) {
    Lanes acc[kChunk] = {};
    for (int64_t c = 0; c < k_len; ++c) {
      const float* wc = site.w_t + c * m + i0;
      for (int64_t j = 0; j < kChunk; ++j) acc[j] += x[c] * wc[j];
    }
    for (int64_t j = 0; j < kChunk; ++j) z[i0 + j] = acc[j];
  }
  for (; i0 < m; ++i0) {
    Lanes acc = {};
    for (int64_t c = 0; c < k_len; ++c) acc += x[c] * site.w_t[c * m + i0];
    z[i0] = acc;
  }
  Lanes r;
  for (int64_t g = 0; g < kBlock; ++g) r[g] = 1.0f / std::sqrt(sq[g] / static_cast<float>(k_len) + site.norm_eps);
  for (int64_t i = 0; i < m; ++i) z[i] = z[i] * r * site.scale[i] + site.base[i];
  const float eps = site.hc_eps;
  const int64_t valid = std::min(kBlock, t_len - t0);
  for (int64_t k = 0; k < n; ++k)
    for (int64_t g = 0; g < valid; ++g) {
      pre[(t0 + g) * n + k] = sigmoid(z[k][g]) + eps;
      post[(t0 + g) * n + k] = 2.0f * sigmoid(z[n + k][g]);
    }
  for (int64_t j = 0; j < n; ++j) {  // softmax of each row of comb, + eps
    const Lanes* zr = z + 2 * n + j * n;
    Lanes* cr = comb + j * n;
    Lanes top = zr[0];
    for (int64_t k = 1; k < n; ++k)
      for (int64_t g = 0; g < kBlock; ++g) top[g] = std::max(top[g], zr[k][g]);
    Lanes total = {};
    for (int64_t k = 0; k < n; ++k) {
      for (int64_t g = 0; g < kBlock; ++g) cr[k][g] = std::exp(zr[k][g] - top[g]);
      total += cr[k];
    }
    for (int64_t k = 0; k < n; ++k) cr[k] = cr[k] / total + eps;
  }
  normalise(comb, n, eps, false);
  for (int64_t it = 1; it < site.iters; ++it) {
    normalise(comb, n, eps, true);
    normalise(comb, n, eps, false);
  }
  for (int64_t g = 0; g < valid; ++g)
    for (int64_t e = 0; e < n * n; ++e) comb_out[(t0 + g) * n * n + e] = comb[e][g];
}

}  // namespace

// s [..., n, D], fn_t [n * D, M] (fn transposed), scale [M], base [M] -> (pre [..., n],
// post [..., n], comb [..., n, n])
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> hc_mixes(torch::Tensor s, torch::Tensor fn_t,
                                                                 torch::Tensor scale, torch::Tensor base,
                                                                 double norm_eps, double hc_eps, int64_t iters) {
  replaykv::check_float_cpu(s, "hc_mixes streams");
  const auto lead = replaykv::lead_shape(s, 2, "hc_mixes streams");
  replaykv::check_dims(fn_t, 2, "hc_mixes fn_t");
  replaykv::check_dims(scale, 1, "hc_mixes scale");
  replaykv::check_dims(base, 1, "hc_mixes base");
  const int64_t t_len = replaykv::count(lead), n = s.size(-2), d = s.size(-1), k_len = n * d, m = (2 + n) * n;
  TORCH_CHECK(fn_t.size(0) == k_len && fn_t.size(1) == m, "hc_mixes: fn_t must be [n * D, (2 + n) * n]");
  TORCH_CHECK(scale.size(0) == m && base.size(0) == m, "hc_mixes: scale and base must have (2 + n) * n values");
  TORCH_CHECK(iters >= 1, "hc_mixes: iters must be at least 1");
  s = s.contiguous();
  fn_t = fn_t.contiguous();
  scale = scale.contiguous();
  base = base.contiguous();
  auto pre = torch::empty(replaykv::with(lead, {n}), s.options());
  auto post = torch::empty(replaykv::with(lead, {n}), s.options());
  auto comb = torch::empty(replaykv::with(lead, {n, n}), s.options());
  if (t_len == 0) return {pre, post, comb};
  const Site site{fn_t.data_ptr<float>(), scale.data_ptr<float>(), base.data_ptr<float>(), n, k_len, m, iters,
                  static_cast<float>(norm_eps), static_cast<float>(hc_eps)};
  const float* sp = s.data_ptr<float>();
  float* prep = pre.data_ptr<float>();
  float* postp = post.data_ptr<float>();
  float* combp = comb.data_ptr<float>();
  const int64_t blocks = (t_len + kBlock - 1) / kBlock;
  at::parallel_for(0, blocks, kGrainBlocks, [&](int64_t begin, int64_t end) {
    std::vector<Lanes> scratch(k_len + m + n * n);
    Lanes* x = scratch.data();
    for (int64_t b = begin; b < end; ++b)
      block(site, sp, b * kBlock, t_len, x, x + k_len, x + k_len + m, prep, postp, combp);
  });
  return {pre, post, comb};
}

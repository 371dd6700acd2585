// The model's products for inference, y = x w^T, with every output computed the same way for a
// row alone (a decode step) as among any number of rows (a prefill).
//
// BLAS computes a few rows with other kernels than many rows, and those round differently; the
// torch path therefore pads small inputs to 16 rows (`layers.MIN_GEMM_ROWS`), sixteen times the
// arithmetic of a decode step's product. Here each output y[i, j] is one chain of multiply-adds
// over k = 0, 1, ..., K - 1 in order (x[i, k] times w's transpose wt[k, j]), started from zero.
// Rows go in tiles of up to 4 and outputs in vectors of 16 (4 x 4 vectors of accumulators in
// registers; the input chunked by 256 so a chunk of wt stays in cache, an output's chain carried
// from chunk to chunk through y unchanged). A tile decides which outputs share loads, never an
// output's operations: y[i, j] depends on x[i] and wt[:, j] alone. wt comes transposed and its
// outputs padded to a multiple of 16 (`native.linear_weight`, kept per weight by the caller).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

using replaykv::kLanes;
using replaykv::Lanes;
using replaykv::load;
using replaykv::store;

constexpr int kRows = 4;                // rows of a tile
constexpr int kVecs = 4;                // output vectors of a tile (64 outputs)
constexpr int64_t kRowBlock = 64;       // rows of a thread's work unit
constexpr int64_t kChunk = 256;         // inputs of a chunk
constexpr int64_t kGrainWork = 1 << 16;  // multiply-adds a thread takes at least

// One product of a call (one group): x rows `xs` floats apart, y rows `ys` apart, wt [k, np].
struct Product {
  const float* x;
  const float* wt;
  float* y;
  int64_t k, np, xs, ys;
};

// y[i0 .. i0 + R, j0 .. j0 + 16 V) over inputs [k0, k1): a fresh chain at k0 == 0, else continued
// from y.
template <int R, int V>
inline void tile(const Product& p, int64_t i0, int64_t j0, int64_t k0, int64_t k1) {
  Lanes acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = k0 == 0 ? Lanes{} : load(p.y + (i0 + r) * p.ys + j0 + v * kLanes);
  for (int64_t c = k0; c < k1; ++c) {
    Lanes wv[V];
    for (int v = 0; v < V; ++v) wv[v] = load(p.wt + c * p.np + j0 + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const float xs = p.x[(i0 + r) * p.xs + c];
      for (int v = 0; v < V; ++v) acc[r][v] += xs * wv[v];
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) store(p.y + (i0 + r) * p.ys + j0 + v * kLanes, acc[r][v]);
}

template <int R>
void rows_tile(const Product& p, int64_t i0, int64_t k0, int64_t k1) {
  int64_t j = 0;
  for (; j + kVecs * kLanes <= p.np; j += kVecs * kLanes) tile<R, kVecs>(p, i0, j, k0, k1);
  switch ((p.np - j) / kLanes) {
    case 3: tile<R, 3>(p, i0, j, k0, k1); break;
    case 2: tile<R, 2>(p, i0, j, k0, k1); break;
    case 1: tile<R, 1>(p, i0, j, k0, k1); break;
    default: break;
  }
}

void row_block(const Product& p, int64_t r0, int64_t r1) {
  for (int64_t k0 = 0; k0 < p.k; k0 += kChunk) {
    const int64_t k1 = std::min(p.k, k0 + kChunk);
    int64_t i = r0;
    for (; i + kRows <= r1; i += kRows) rows_tile<kRows>(p, i, k0, k1);
    switch (r1 - i) {
      case 3: rows_tile<3>(p, i, k0, k1); break;
      case 2: rows_tile<2>(p, i, k0, k1); break;
      case 1: rows_tile<1>(p, i, k0, k1); break;
      default: break;
    }
  }
}

}  // namespace

// w [N, K] or [G, N, K] -> wt [K, Np] or [G, K, Np] (Np: N rounded up to 16), zeros past N
torch::Tensor linear_weight(torch::Tensor w) {
  replaykv::check_float_cpu(w, "linear_weight w");
  TORCH_CHECK(w.dim() == 2 || w.dim() == 3, "linear_weight: w must be [N, K] or [G, N, K]");
  const int64_t n = w.size(-2), np = (n + kLanes - 1) / kLanes * kLanes;
  auto sizes = w.sizes().vec();
  sizes[w.dim() - 2] = w.size(-1);
  sizes[w.dim() - 1] = np;
  auto wt = torch::zeros(sizes, w.options());
  wt.narrow(-1, 0, n).copy_(w.transpose(-1, -2));
  return wt;
}

// x [..., K] with wt [K, Np], or x [..., G, K] with wt [G, K, Np] (each group its own product),
// from `linear_weight`; n <= Np -> [..., n] or [..., G, n]
torch::Tensor linear(torch::Tensor x, torch::Tensor wt, int64_t n) {
  replaykv::check_float_cpu(x, "linear x");
  replaykv::check_float_cpu(wt, "linear wt");
  TORCH_CHECK(wt.dim() == 2 || wt.dim() == 3, "linear: wt must be [K, Np] or [G, K, Np]");
  const int64_t groups = wt.dim() == 3 ? wt.size(0) : 1, k = wt.size(-2), np = wt.size(-1);
  const auto lead = replaykv::lead_shape(x, wt.dim() - 1, "linear x");
  TORCH_CHECK(x.size(-1) == k && (wt.dim() == 2 || x.size(-2) == groups) && np % kLanes == 0 && n >= 0 && n <= np,
              "linear: wt ", wt.sizes(), " (from linear_weight) does not fit x ", x.sizes(), " and N = ", n);
  TORCH_CHECK(wt.is_contiguous(), "linear: wt must be contiguous");
  const int64_t m = replaykv::count(lead);
  x = x.contiguous();
  auto y = torch::empty({m, groups, np}, x.options());
  if (m > 0 && np > 0 && k == 0) y.zero_();
  if (m > 0 && np > 0 && k > 0) {
    const float* xp = x.data_ptr<float>();
    const float* wp = wt.data_ptr<float>();
    float* yp = y.data_ptr<float>();
    const int64_t blocks = (m + kRowBlock - 1) / kRowBlock;
    const int64_t per_unit = std::min(m, kRowBlock) * np * k;
    at::parallel_for(0, blocks * groups, std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, per_unit)),
                     [&](int64_t begin, int64_t end) {
                       for (int64_t u = begin; u < end; ++u) {
                         const int64_t g = u % groups, blk = u / groups;
                         const Product p{xp + g * k, wp + g * k * np, yp + g * np, k, np, groups * k, groups * np};
                         row_block(p, blk * kRowBlock, std::min(m, (blk + 1) * kRowBlock));
                       }
                     });
  }
  if (np != n) y = y.narrow(2, 0, n).contiguous();
  return wt.dim() == 3 ? y.view(replaykv::with(lead, {groups, n})) : y.view(replaykv::with(lead, {n}));
}

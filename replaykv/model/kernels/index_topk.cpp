// The lightning indexer's scoring and top-k for a block of queries in one pass, on the CPU.
//
// score(i, j) = sum_h w[i, h] * (relu(q[i, h] . keys[j]) * post_scale), each query against the
// entries j < lim[i]; the best k per query, ranked by score descending and then index ascending
// (NaN above every number), -1 where fewer are visible. No [Q, H, N] or [Q, N] tensor is built:
// a unit of queries transposes each tile of keys it reaches once and scores it for all its queries, and each query keeps
// its best k in a small buffer that a new entry enters only when it ranks above the buffer's
// worst.
//
// Rounding: every score is computed by the same loop whatever the block, the query's neighbours
// or the number of entries, so a query's selection does not depend on how the sequence was cut
// into calls (decode rows equal their prefill rows). The dot over channels is one chain of
// multiply-adds in channel order; it may round differently from a BLAS product of the same
// operands (the torch path in attention.py), by an ulp or so of the dot.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTile = 64;  // entries scored together (four 16-float vectors)
constexpr int64_t kChunk = 32;  // queries that share each tile of keys while it is in cache

constexpr int64_t kLanes = 16;  // floats in one vector below
static_assert(kTile == 4 * kLanes, "add_heads keeps four key vectors in registers");
typedef float V __attribute__((vector_size(kLanes * sizeof(float)), aligned(64)));

constexpr int kV = kTile / kLanes;

// score[v] += w[hh] * (relu(q[hh] . tile[:, t]) * post_scale) for HN heads in order (q [HN, d]),
// each head's dot one chain of multiply-adds per entry over the channels in order.
template <int HN>
inline void add_heads(const float* q, const float* w, const float* tile, int64_t d, float post_scale, V (&score)[kV]) {
  V acc[HN][kV] = {};  // 4·HN independent chains, in registers
  for (int64_t c = 0; c < d; ++c) {
    V kv[kV];
    for (int v = 0; v < kV; ++v) kv[v] = *reinterpret_cast<const V*>(tile + c * kTile + v * kLanes);
    // Keep the key vectors in registers: each is read by HN multiply-adds, which the compiler
    // would otherwise give a memory operand each (a load apiece).
    asm("" : "+v"(kv[0]), "+v"(kv[1]), "+v"(kv[2]), "+v"(kv[3]));
    for (int hh = 0; hh < HN; ++hh) {
      const float qc = q[hh * d + c];
      for (int v = 0; v < kV; ++v) acc[hh][v] += qc * kv[v];
    }
  }
  const V zero = {};
  for (int hh = 0; hh < HN; ++hh)
    for (int v = 0; v < kV; ++v) {
      const V relu = acc[hh][v] < zero ? zero : acc[hh][v];  // NaN stays NaN, as torch's relu
      score[v] += w[hh] * (relu * post_scale);
    }
}

// score[t] = sum_h w[h] * (relu(q[h] . tile[:, t]) * post_scale) for the tile's kTile entries,
// the heads summed in order, four at a time, sixteen entries a vector.
inline void score_tile(const float* q, const float* w, const float* tile, int64_t h, int64_t d,
                       float post_scale, float* score) {
  V s[kV] = {};
  for (int64_t h0 = 0; h0 < h; h0 += 4) {
    switch (std::min<int64_t>(4, h - h0)) {
      case 4: add_heads<4>(q + h0 * d, w + h0, tile, d, post_scale, s); break;
      case 3: add_heads<3>(q + h0 * d, w + h0, tile, d, post_scale, s); break;
      case 2: add_heads<2>(q + h0 * d, w + h0, tile, d, post_scale, s); break;
      default: add_heads<1>(q + h0 * d, w + h0, tile, d, post_scale, s); break;
    }
  }
  for (int v = 0; v < kV; ++v) *reinterpret_cast<V*>(score + v * kLanes) = s[v];
}

// a ranks above b: larger score first, NaN above every number, equal scores by lower index.
inline bool ranks_above(float a, int64_t ia, float b, int64_t ib) {
  const bool na = std::isnan(a), nb = std::isnan(b);
  if (na || nb) return (na && nb) ? ia < ib : na;
  if (a != b) return a > b;
  return ia < ib;
}

struct Entry {
  float score;
  int64_t index;
};

// The heap order: an entry "less" than another ranks above it, so the heap's front is the entry
// that ranks last among those kept (the one a better newcomer replaces).
inline bool heap_less(const Entry& a, const Entry& b) { return ranks_above(a.score, a.index, b.score, b.index); }

struct Best {  // one query's best entries so far, a heap with the last-ranked in front
  Entry* heap;
  int64_t count = 0;

  float worst() const { return heap[0].score; }

  // Entries arrive in index order, so a newcomer ranks above the front only by its score.
  void offer(float s, int64_t j, int64_t k) {
    if (count < k) {
      heap[count++] = {s, j};
      std::push_heap(heap, heap + count, heap_less);
      return;
    }
    const float ws = heap[0].score;
    if (s <= ws || std::isnan(ws)) return;  // only a larger score or a NaN gets in (a NaN front: all kept are NaN)
    std::pop_heap(heap, heap + count, heap_less);
    heap[count - 1] = {s, j};
    std::push_heap(heap, heap + count, heap_less);
  }
};

// Queries [i0, i1) of batch row b; keys [n, d] of that row.
void select_rows(const float* q, const float* w, const float* keys, const int64_t* lim, int64_t* out,
                 int64_t n, int64_t h, int64_t d, int64_t k, float post_scale, int64_t i0, int64_t i1) {
  const int64_t rows = i1 - i0;
  std::vector<Entry> kept(rows * k);
  std::vector<Best> best(rows);
  int64_t reach = 0;  // entries any query of the range sees
  for (int64_t r = 0; r < rows; ++r) {
    best[r].heap = kept.data() + r * k;
    reach = std::max(reach, std::min(lim[i0 + r], n));
  }
  alignas(64) float score[kTile];
  std::vector<V> tile_buf(d * kV);  // one tile transposed, [d, kTile], zero past the last entry
  float* tile = reinterpret_cast<float*>(tile_buf.data());
  for (int64_t j0 = 0; j0 < reach; j0 += kTile) {
    const int64_t width = std::min(kTile, reach - j0);
    for (int64_t t = 0; t < kTile; ++t)
      for (int64_t c = 0; c < d; ++c) tile[c * kTile + t] = t < width ? keys[(j0 + t) * d + c] : 0.0f;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t i = i0 + r;
      const int64_t visible = std::min(lim[i], n) - j0;
      if (visible <= 0) continue;
      score_tile(q + i * h * d, w + i * h, tile, h, d, post_scale, score);
      const int64_t m = std::min(width, visible);
      Best& b = best[r];
      if (b.count == k && !std::isnan(b.worst())) {  // most tiles: nothing gets in
        const float ws = b.worst();
        int any = 0;
        for (int64_t t = 0; t < m; ++t) any |= !(score[t] <= ws);
        if (!any) continue;
      }
      for (int64_t t = 0; t < m; ++t) b.offer(score[t], j0 + t, k);
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    Best& b = best[r];
    std::sort(b.heap, b.heap + b.count, heap_less);  // best first
    int64_t* o = out + (i0 + r) * k;
    for (int64_t m = 0; m < b.count; ++m) o[m] = b.heap[m].index;
  }
}

}  // namespace

// q [B, Q, H, D], w [B, Q, H], keys [B, N, D] (float32), lim [B, Q] (int64: entries
// visible to each query) -> [B, Q, k] int64 entry ids, -1 where fewer than k are visible.
torch::Tensor index_topk(torch::Tensor q, torch::Tensor w, torch::Tensor keys, torch::Tensor lim,
                         int64_t k, double post_scale) {
  TORCH_CHECK(q.dim() == 4 && w.dim() == 3 && keys.dim() == 3 && lim.dim() == 2, "index_topk: bad ranks");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat &&
                  keys.scalar_type() == torch::kFloat && lim.scalar_type() == torch::kLong,
              "index_topk: q, w and keys are float32, lim int64");
  TORCH_CHECK(q.device().is_cpu(), "index_topk runs on the CPU");
  const int64_t b = q.size(0), nq = q.size(1), h = q.size(2), d = q.size(3), n = keys.size(1);
  TORCH_CHECK(w.size(0) == b && w.size(1) == nq && w.size(2) == h, "index_topk: w does not match q");
  TORCH_CHECK(keys.size(0) == b && keys.size(2) == d, "index_topk: keys do not match q");
  TORCH_CHECK(lim.size(0) == b && lim.size(1) == nq, "index_topk: lim does not match q");
  TORCH_CHECK(k >= 0, "index_topk: k < 0");
  q = q.contiguous();
  w = w.contiguous();
  keys = keys.contiguous();
  lim = lim.contiguous();
  auto out = torch::full({b, nq, k}, -1, torch::kLong);
  if (k == 0 || nq == 0 || n == 0) return out;
  const float* qp = q.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* kp = keys.data_ptr<float>();
  const int64_t* lp = lim.data_ptr<int64_t>();
  int64_t* op = out.data_ptr<int64_t>();
  const float ps = static_cast<float>(post_scale);
  // Work in units of up to kChunk queries of one batch row, each unit against the entries its
  // queries see. Later queries see more entries, so units are dealt from both ends of each row
  // (0, last, 1, last - 1, ...) and a thread's contiguous share holds early and late ones alike.
  // A query's result does not depend on the unit it falls in.
  const int64_t per_row = (nq + kChunk - 1) / kChunk;
  // A call of little work (a short prompt, a decode step) runs on the calling thread alone: a
  // parallel region costs more than it saves there.
  const int64_t unit_work = std::max<int64_t>(1, kChunk * n * h * d);
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 22) / unit_work);
  at::parallel_for(0, b * per_row, grain, [&](int64_t begin, int64_t end) {
    for (int64_t u = begin; u < end; ++u) {
      const int64_t row = u / per_row, v = u % per_row;
      const int64_t c = (v % 2 == 0) ? v / 2 : per_row - 1 - v / 2;
      const int64_t i0 = c * kChunk, i1 = std::min(nq, i0 + kChunk);
      select_rows(qp + row * nq * h * d, wp + row * nq * h, kp + row * n * d, lp + row * nq, op + row * nq * k,
                  n, h, d, k, ps, i0, i1);
    }
  });
  return out;
}

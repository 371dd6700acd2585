// DeepSeek-V4's joint attention for inference: each query's one softmax over its window keys,
// its visible compressed entries and its head's sink, in one pass per query.
//
// For query i of batch row b with heads q_h (D floats each), its key rows K (the W window rows
// win[b, i .. i + W - 1] that are readable, then the entries: rows 0 .. limit[b, i] - 1 of a
// dense layer, or the selected ids of a sparse layer in their given order, -1 skipped):
//
//   l_hr = (q_h . k_r) * scale,  m_h = max(sink_h, max_r l_hr)
//   o_h  = sum_r exp(l_hr - m_h) k_r / (sum_r exp(l_hr - m_h) + exp(sink_h - m_h))
//
// (the keys are the values: shared-KV MQA). torch runs this as an unfold copy of the window,
// batched products, masks, a max, exponentials and sums per block of queries, a few dozen
// operations a layer in a decode step. Here a query's values come from its own operands in a
// fixed order: each dot product is 16 lane-wise partial sums over D added as a fixed tree, the
// exponential is one polynomial (`exp_le0`, within about 2 ulps of expf) whatever lane computes
// it, and every sum over keys runs in key order. A query's result therefore depends on nothing
// but its own operands: a decode step equals its prefill row, and a chunked prefill the whole
// one; against torch's operations values may differ by a few ulps.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include "common.h"

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

using replaykv::kLanes;
using replaykv::Lanes;
using replaykv::load;
using replaykv::store;

constexpr int64_t kHeadBlock = 4;   // heads whose output accumulators share a pass over the keys
constexpr int64_t kOutChunk = 64;   // output floats per head in registers at a time (4 vectors)
constexpr int64_t kGrainWork = 1 << 18;  // dot-product floats a thread takes at least

typedef float Half __attribute__((vector_size(kLanes / 2 * sizeof(float))));
typedef float Quarter __attribute__((vector_size(kLanes / 4 * sizeof(float))));
typedef int32_t IntLanes __attribute__((vector_size(kLanes * sizeof(int32_t))));

// The 16 lanes added as a fixed tree (halves, quarters, then pairs).
inline float lane_sum(Lanes v) {
  Half lo, hi;
  std::memcpy(&lo, &v, sizeof(lo));
  std::memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(lo), sizeof(hi));
  const Half a = lo + hi;
  Quarter qlo, qhi;
  std::memcpy(&qlo, &a, sizeof(qlo));
  std::memcpy(&qhi, reinterpret_cast<const char*>(&a) + sizeof(qlo), sizeof(qhi));
  const Quarter b = qlo + qhi;
  return (b[0] + b[2]) + (b[1] + b[3]);
}

// q . k over d floats: whole runs of 16 in lane-wise partial sums, the tail added after the tree.
inline float dot(const float* q, const float* k, int64_t d) {
  Lanes acc = {};
  int64_t c = 0;
  for (; c + kLanes <= d; c += kLanes) acc += load(q + c) * load(k + c);
  float total = lane_sum(acc);
  for (; c < d; ++c) total += q[c] * k[c];
  return total;
}

// exp(x) for x <= 0 (a softmax's shifted logits), 0 below -87.3 (where expf leaves the normal
// range): x = n ln2 + r with |r| <= ln2 / 2, exp(r) by its degree-7 Taylor polynomial (relative
// error below 1e-8) times 2^n built in the exponent bits. The same operations in every lane, so
// a value's exponential does not depend on its neighbours.
inline Lanes exp_le0(Lanes x) {
  const Lanes magic = Lanes{} + 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  x = x < -87.3f ? Lanes{} - 87.3f : x;
  const Lanes t = x * 1.44269504088896341f + magic;
  const Lanes n = t - magic;
  const Lanes r = (x - n * 0.693145751953125f) - n * 1.42860682030941723e-6f;
  Lanes p = Lanes{} + (1.0f / 5040.0f);
  p = p * r + (1.0f / 720.0f);
  p = p * r + (1.0f / 120.0f);
  p = p * r + (1.0f / 24.0f);
  p = p * r + (1.0f / 6.0f);
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  IntLanes bits, magic_bits;
  std::memcpy(&bits, &t, sizeof(bits));
  std::memcpy(&magic_bits, &magic, sizeof(magic_bits));
  const IntLanes e = ((bits - magic_bits) + 127) << 23;  // 2^n, n >= -126 after the clamp
  Lanes scale;
  std::memcpy(&scale, &e, sizeof(scale));
  const Lanes y = p * scale;
  return x <= -87.3f ? Lanes{} : y;
}

struct Operands {
  const float* q;        // [B, S, H, D]
  const float* win;      // [B, W - 1 + S, D], or a ring [B, R, D] (ring_first given)
  const int64_t* ring_first;  // [B]: the ring slot of window row 0, or null
  const bool* key_ok;    // [B, W - 1 + S] or null (every window row readable)
  const float* sinks;    // [H]
  const float* entries;  // [B, N, D] or null
  const int64_t* limit;  // [B, S] entries visible (dense) or null
  const int64_t* sel;    // [B, S, k] selected ids (sparse) or null
  float* out;            // [B, S, H, D]
  int64_t s, h, d, w, n, k, ring;
  float scale;
};

// Scratch of one thread: the query's key rows and its logits / weights [H, rows].
struct Scratch {
  std::vector<const float*> rows;
  std::vector<float> logits;
};

// One query; false if a selected id is out of range.
bool attend(const Operands& o, int64_t b, int64_t i, Scratch& sc) {
  const int64_t h_len = o.h, d = o.d, w = o.w, win_rows = w - 1 + o.s;
  auto& rows = sc.rows;
  rows.clear();
  for (int64_t j = i; j < i + w; ++j) {
    if (o.key_ok != nullptr && !o.key_ok[b * win_rows + j]) continue;
    if (o.ring_first == nullptr)
      rows.push_back(o.win + (b * win_rows + j) * d);
    else
      rows.push_back(o.win + (b * o.ring + (o.ring_first[b] + j) % o.ring) * d);
  }
  if (o.entries != nullptr) {
    const float* ent = o.entries + b * o.n * d;
    if (o.sel != nullptr) {
      const int64_t* sel = o.sel + (b * o.s + i) * o.k;
      for (int64_t j = 0; j < o.k; ++j) {
        if (sel[j] < 0) continue;
        if (sel[j] >= o.n) return false;
        rows.push_back(ent + sel[j] * d);
      }
    } else {
      const int64_t visible = std::min(o.n, std::max<int64_t>(0, o.limit[b * o.s + i]));
      for (int64_t j = 0; j < visible; ++j) rows.push_back(ent + j * d);
    }
  }
  const int64_t m = static_cast<int64_t>(rows.size());
  const int64_t stride = (m + kLanes - 1) / kLanes * kLanes;  // a head's logits, whole runs of 16
  sc.logits.resize(h_len * stride);
  float* lg = sc.logits.data();
  const float* q = o.q + (b * o.s + i) * h_len * d;
  float* out = o.out + (b * o.s + i) * h_len * d;
  for (int64_t r = 0; r < m; ++r)
    for (int64_t hh = 0; hh < h_len; ++hh) lg[hh * stride + r] = dot(q + hh * d, rows[r], d) * o.scale;
  std::vector<float> den(h_len);
  for (int64_t hh = 0; hh < h_len; ++hh) {  // weights exp(l - m) in place, and their sum
    float* l = lg + hh * stride;
    float top = o.sinks[hh];
    for (int64_t r = 0; r < m; ++r) top = std::max(top, l[r]);
    for (int64_t r = m; r < stride; ++r) l[r] = top;  // padding: exp(0), never read
    for (int64_t r = 0; r < stride; r += kLanes) {
      const Lanes e = exp_le0(load(l + r) - top);
      store(l + r, e);
    }
    float total = 0.0f;
    for (int64_t r = 0; r < m; ++r) total += l[r];
    const Lanes sink = exp_le0(Lanes{} + (o.sinks[hh] - top));
    den[hh] = total + sink[0];
  }
  // o_h = sum_r p_hr k_r in key order, kHeadBlock heads x kOutChunk floats in registers at a time.
  for (int64_t h0 = 0; h0 < h_len; h0 += kHeadBlock) {
    const int64_t hb = std::min(kHeadBlock, h_len - h0);
    int64_t c0 = 0;
    for (; c0 + kOutChunk <= d; c0 += kOutChunk) {
      Lanes acc[kHeadBlock][kOutChunk / kLanes] = {};
      for (int64_t r = 0; r < m; ++r) {
        const float* k = rows[r] + c0;
        Lanes kv[kOutChunk / kLanes];
        for (int64_t v = 0; v < kOutChunk / kLanes; ++v) kv[v] = load(k + v * kLanes);
        for (int64_t hh = 0; hh < hb; ++hh) {
          const float p = lg[(h0 + hh) * stride + r];
          for (int64_t v = 0; v < kOutChunk / kLanes; ++v) acc[hh][v] += p * kv[v];
        }
      }
      for (int64_t hh = 0; hh < hb; ++hh)
        for (int64_t v = 0; v < kOutChunk / kLanes; ++v) {
          const Lanes y = acc[hh][v] / den[h0 + hh];
          store(out + (h0 + hh) * d + c0 + v * kLanes, y);
        }
    }
    for (int64_t hh = 0; hh < hb; ++hh)  // the last D % 64 floats, one at a time in key order
      for (int64_t c = c0; c < d; ++c) {
        float acc = 0.0f;
        for (int64_t r = 0; r < m; ++r) acc += lg[(h0 + hh) * stride + r] * rows[r][c];
        out[(h0 + hh) * d + c] = acc / den[h0 + hh];
      }
  }
  return true;
}

}  // namespace

// q [B, S, H, D]; win [B, W - 1 + S, D] (query i reads rows i .. i + W - 1), or with ring_first
// [B] int64 a ring [B, R, D] whose slot (ring_first[b] + j) % R holds window row j; key_ok
// [B, W - 1 + S] bool or empty; sinks [H]; entries [B, N, D] or empty; limit [B, S] int64 (dense:
// entries each query sees) or empty; sel [B, S, k] int64 (sparse: selected ids, -1 none) or
// empty -> [B, S, H, D]
torch::Tensor joint_attention(torch::Tensor q, torch::Tensor win, torch::Tensor ring_first, torch::Tensor key_ok,
                              torch::Tensor sinks, torch::Tensor entries, torch::Tensor limit, torch::Tensor sel,
                              int64_t window, double scale) {
  replaykv::check_dims(q, 4, "joint_attention q");
  const int64_t b = q.size(0), s = q.size(1), h = q.size(2), d = q.size(3), w = window;
  TORCH_CHECK(w >= 1, "joint_attention: window must be at least 1");
  const bool ring = ring_first.numel() > 0;
  if (ring) {
    replaykv::check_dims(win, 3, "joint_attention ring");
    TORCH_CHECK(win.size(0) == b && win.size(2) == d && win.size(1) >= 1, "joint_attention: the ring does not match q");
    TORCH_CHECK(ring_first.scalar_type() == torch::kLong && ring_first.dim() == 1 && ring_first.size(0) == b,
                "joint_attention: ring_first must be int64 [B]");
    ring_first = ring_first.remainder(win.size(1)).contiguous();  // a slot in [0, R)
  } else {
    replaykv::expect(win, {b, w - 1 + s}, {d}, "joint_attention win");
  }
  replaykv::expect(sinks, {}, {h}, "joint_attention sinks");
  const bool masked = key_ok.numel() > 0, has_entries = entries.numel() > 0, sparse = sel.numel() > 0;
  if (masked) {
    TORCH_CHECK(key_ok.scalar_type() == torch::kBool && key_ok.dim() == 2 && key_ok.size(0) == b &&
                    key_ok.size(1) == w - 1 + s,
                "joint_attention: key_ok must be bool [B, W - 1 + S]");
    key_ok = key_ok.contiguous();
  }
  int64_t n = 0, k = 0;
  if (has_entries) {
    replaykv::check_dims(entries, 3, "joint_attention entries");
    TORCH_CHECK(entries.size(0) == b && entries.size(2) == d, "joint_attention: entries do not match q");
    n = entries.size(1);
    entries = entries.contiguous();
    if (sparse) {
      TORCH_CHECK(sel.scalar_type() == torch::kLong && sel.dim() == 3 && sel.size(0) == b && sel.size(1) == s,
                  "joint_attention: sel must be int64 [B, S, k]");
      k = sel.size(2);
      sel = sel.contiguous();
    } else {
      TORCH_CHECK(limit.scalar_type() == torch::kLong && limit.dim() == 2 && limit.size(0) == b &&
                      limit.size(1) == s,
                  "joint_attention: limit must be int64 [B, S]");
      limit = limit.contiguous();
    }
  }
  q = q.contiguous();
  win = win.contiguous();
  sinks = sinks.contiguous();
  auto out = torch::empty_like(q);
  if (b * s * h == 0) return out;
  const Operands ops{q.data_ptr<float>(),
                     win.data_ptr<float>(),
                     ring ? ring_first.data_ptr<int64_t>() : nullptr,
                     masked ? key_ok.data_ptr<bool>() : nullptr,
                     sinks.data_ptr<float>(),
                     has_entries ? entries.data_ptr<float>() : nullptr,
                     has_entries && !sparse ? limit.data_ptr<int64_t>() : nullptr,
                     has_entries && sparse ? sel.data_ptr<int64_t>() : nullptr,
                     out.data_ptr<float>(),
                     s,
                     h,
                     d,
                     w,
                     n,
                     k,
                     ring ? win.size(1) : 0,
                     static_cast<float>(scale)};
  const int64_t per_query = h * d * (w + (sparse ? k : n));
  std::atomic<bool> bad{false};
  at::parallel_for(0, b * s, std::max<int64_t>(1, kGrainWork / std::max<int64_t>(1, per_query)),
                   [&](int64_t begin, int64_t end) {
                     Scratch sc;
                     for (int64_t u = begin; u < end; ++u)
                       if (!attend(ops, u / s, u % s, sc)) bad = true;
                   });
  TORCH_CHECK(!bad, "joint_attention: a selected entry id is past the entries");
  return out;
}

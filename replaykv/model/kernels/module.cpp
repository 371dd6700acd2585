// The Python module of the native CPU kernels (see replaykv/model/native.py).
#include <torch/extension.h>

torch::Tensor index_topk(torch::Tensor q, torch::Tensor w, torch::Tensor keys, torch::Tensor lim, int64_t k,
                         double post_scale);
torch::Tensor hc_collapse(torch::Tensor s, torch::Tensor pre);
torch::Tensor hc_expand(torch::Tensor s, torch::Tensor out, torch::Tensor post, torch::Tensor comb);
std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> hc_mixes(torch::Tensor s, torch::Tensor fn_t,
                                                                 torch::Tensor scale, torch::Tensor base,
                                                                 double norm_eps, double hc_eps, int64_t iters);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor joint_attention(torch::Tensor q, torch::Tensor win, torch::Tensor ring_first, torch::Tensor key_ok,
                              torch::Tensor sinks, torch::Tensor entries, torch::Tensor limit, torch::Tensor sel,
                              int64_t window, double scale);
torch::Tensor linear_weight(torch::Tensor w);
torch::Tensor linear(torch::Tensor x, torch::Tensor wt, int64_t n);
torch::Tensor rope(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, int64_t heads, bool inverse);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("index_topk", &index_topk, "DeepSeek-V4's lightning indexer: scores, causal mask and top-k in one pass");
  m.def("hc_collapse", &hc_collapse, "mHC collapse: sum_k pre[t, k] * s[t, k, :]");
  m.def("rms_norm", &rms_norm, "RMS norm of each row, optionally weighted");
  m.def("rope", &rope, "rotary embedding of each head's trailing channels");
  m.def("hc_mixes", &hc_mixes, "mHC mixes: RMS norm, product, sigmoids, softmax and Sinkhorn per token");
  m.def("joint_attention", &joint_attention,
        "DeepSeek-V4's joint attention over window keys, compressed entries and sinks, per query");
  m.def("linear_weight", &linear_weight, "w transposed, its outputs padded to a multiple of 16, for linear");
  m.def("linear", &linear, "x w^T with each output one chain of multiply-adds in input order");
  m.def("hc_expand", &hc_expand, "mHC expand: post[t, k] * out[t, :] + sum_j comb[t, j, k] * s[t, j, :]");
}

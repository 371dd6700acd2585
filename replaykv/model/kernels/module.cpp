// The Python module of the native CPU kernels (see replaykv/model/native.py).
#include <torch/extension.h>

torch::Tensor index_topk(torch::Tensor q, torch::Tensor w, torch::Tensor keys, torch::Tensor lim, int64_t k,
                         double post_scale);
torch::Tensor hc_collapse(torch::Tensor s, torch::Tensor pre);
torch::Tensor hc_expand(torch::Tensor s, torch::Tensor out, torch::Tensor post, torch::Tensor comb);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("index_topk", &index_topk, "DeepSeek-V4's lightning indexer: scores, causal mask and top-k in one pass");
  m.def("hc_collapse", &hc_collapse, "mHC collapse: sum_k pre[t, k] * s[t, k, :]");
  m.def("hc_expand", &hc_expand, "mHC expand: post[t, k] * out[t, :] + sum_j comb[t, j, k] * s[t, j, :]");
}

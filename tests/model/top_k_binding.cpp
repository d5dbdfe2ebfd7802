// The greedy logits pass alone (top_k.cpp), as a module a test builds for another instruction set
// (test_top_k_avx2.py).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

std::vector<at::Tensor> top_k_logsumexp(const at::Tensor& logits, int64_t k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("top_k_logsumexp", &top_k_logsumexp); }

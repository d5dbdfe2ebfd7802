// The paged attention kernel alone, as a module a test builds for another instruction set (test_attention_avx2.py).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                           int64_t tile_min_rows, int64_t few_tile_min_rows, bool tile_pairs, bool tile_f16);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("paged_attention", &paged_attention); }

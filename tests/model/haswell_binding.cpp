// The kernels the AVX2 tests check (paged attention, the fp32 4-bit kernel and its int8-activation form, the int8
// GEMM, the greedy logits pass),
// bound as one module that haswell_build.py builds for another instruction set: one binding to compile, not four.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                           int64_t tile_min_rows, int64_t few_tile_min_rows, bool tile_pairs, bool tile_f16);
at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins);
bool int4_linear_f32_supported();
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins);
bool int4_linear_q8_supported();
void int8_gemm(const at::Tensor& q, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
               const c10::optional<at::Tensor>& col_scale, const c10::optional<at::Tensor>& bias, at::Tensor& out,
               const c10::optional<at::Tensor>& extra_x, const c10::optional<at::Tensor>& extra_w,
               const c10::optional<at::Tensor>& extra_rows);
bool int8_gemm_supported();
int64_t int8_gemm_input_max();
std::vector<at::Tensor> top_k_logsumexp(const at::Tensor& logits, int64_t k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("paged_attention", &paged_attention);
  m.def("int4_linear_f32", &int4_linear_f32);
  m.def("int4_linear_f32_supported", &int4_linear_f32_supported);
  m.def("int4_linear_q8", &int4_linear_q8);
  m.def("int4_linear_q8_supported", &int4_linear_q8_supported);
  m.def("int8_gemm", &int8_gemm, py::arg("q"), py::arg("packed"), py::arg("row_scale"), py::arg("col_scale"),
        py::arg("bias"), py::arg("out"), py::arg("extra_x") = py::none(), py::arg("extra_w") = py::none(),
        py::arg("extra_rows") = py::none());
  m.def("int8_gemm_supported", &int8_gemm_supported);
  m.def("int8_gemm_input_max", &int8_gemm_input_max);
  m.def("top_k_logsumexp", &top_k_logsumexp);
}

// The int8 GEMM alone (int8_linear.cpp beside it for the helpers they share), as a module a test
// builds for another instruction set (test_int8_avx2.py).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

void int8_gemm(const at::Tensor& q, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
               const c10::optional<at::Tensor>& col_scale, const c10::optional<at::Tensor>& bias, at::Tensor& out,
               const c10::optional<at::Tensor>& extra_x, const c10::optional<at::Tensor>& extra_w);
bool int8_gemm_supported();
int64_t int8_gemm_input_max();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  m.def("int8_gemm", &int8_gemm, py::arg("q"), py::arg("packed"), py::arg("row_scale"), py::arg("col_scale"),
        py::arg("bias"), py::arg("out"), py::arg("extra_x") = py::none(), py::arg("extra_w") = py::none());
  m.def("int8_gemm_supported", &int8_gemm_supported);
  m.def("int8_gemm_input_max", &int8_gemm_input_max);
}

#include <torch/extension.h>
void int8_gemm(const at::Tensor& q, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
               const c10::optional<at::Tensor>& col_scale, const c10::optional<at::Tensor>& bias, at::Tensor& out,
               const c10::optional<at::Tensor>& extra_x, const c10::optional<at::Tensor>& extra_w,
               const c10::optional<at::Tensor>& extra_rows);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("int8_gemm", &int8_gemm); }

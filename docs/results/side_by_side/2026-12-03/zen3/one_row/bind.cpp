#include <torch/extension.h>
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins);
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("int4_linear_q8", &int4_linear_q8); }

// The fp32 4-bit kernel alone, as a module a test builds for another instruction set (test_int4_avx2.py).
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>

at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins);
bool int4_linear_f32_supported();

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_f32", &int4_linear_f32);
  m.def("int4_linear_f32_supported", &int4_linear_f32_supported);
}

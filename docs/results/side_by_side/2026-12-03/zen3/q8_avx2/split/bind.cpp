#include <torch/extension.h>
extern int g_probe;
bool int4_linear_q8_supported();
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, const at::Tensor& mins);
void set_probe(int v) { g_probe = v; }
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("int4_linear_q8", &int4_linear_q8);
  m.def("set_probe", &set_probe);
}

// The Python module of pagedllm's C++ kernels: one extension, built from every source in csrc/.
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>  // the Tensor <-> Python caster; lighter to compile than torch/extension.h

at::Tensor paged_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                           const at::Tensor& block_tables, const at::Tensor& context_lens,
                           const at::Tensor& query_start_loc, double scale, int64_t max_query_len,
                           int64_t tile_min_rows, int64_t few_tile_min_rows, bool tile_pairs, bool tile_f16);
bool tile_pairs_supported();
bool tile_f16_supported();
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping);
at::Tensor add_rms_norm(const c10::optional<at::Tensor>& x, at::Tensor& residual, const at::Tensor& weight,
                        double eps);
at::Tensor silu_mul(const at::Tensor& gate_up);
void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);
at::Tensor rotary_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t q_heads,
                           int64_t kv_heads);
std::vector<at::Tensor> top_k_logsumexp(const at::Tensor& logits, int64_t k);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                       const at::Tensor& mins);
bool int4_linear_supported();
at::Tensor int4_linear_f32(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins);
bool int4_linear_f32_supported();
at::Tensor int4_linear_f16(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           const at::Tensor& mins, double w_scale);
bool int4_linear_f16_supported();
at::Tensor int4_linear_q8(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& mins);
bool int4_linear_q8_supported();
at::Tensor exact_logits(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& ids);
std::vector<at::Tensor> rescore_top_k(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& values,
                                      const at::Tensor& ids, const at::Tensor& lse);
at::Tensor truncate_(at::Tensor& logits, const c10::optional<at::Tensor>& top_k,
                     const c10::optional<at::Tensor>& top_p);
at::Tensor draw_rows(const at::Tensor& logits, const at::Tensor& u);
std::vector<at::Tensor> quantize_rows_int8(const at::Tensor& x, int64_t qmax);
std::vector<at::Tensor> split_outliers_int8(const at::Tensor& x, int64_t E, int64_t qmax);
void dequantize_int32(const at::Tensor& acc, const at::Tensor& row_scale, const at::Tensor& col_scale,
                      const c10::optional<at::Tensor>& bias, at::Tensor& out, const c10::optional<at::Tensor>& extra_x,
                      const c10::optional<at::Tensor>& extra_w, const c10::optional<at::Tensor>& extra_rows);
void int8_gemm(const at::Tensor& q, const at::Tensor& packed, const c10::optional<at::Tensor>& row_scale,
               const c10::optional<at::Tensor>& col_scale, const c10::optional<at::Tensor>& bias, at::Tensor& out,
               const c10::optional<at::Tensor>& extra_x, const c10::optional<at::Tensor>& extra_w,
               const c10::optional<at::Tensor>& extra_rows);
bool int8_gemm_supported();
int64_t int8_gemm_input_max();
at::Tensor bf16_gemm(const at::Tensor& x, const at::Tensor& packed);
bool bf16_gemm_supported();
void lora_sgmv(at::Tensor& out, const at::Tensor& x, const at::Tensor& a_pages, const at::Tensor& b_pages,
               const at::Tensor& tokens, const at::Tensor& starts, const at::Tensor& slots, const at::Tensor& ranks,
               int64_t rank, const std::vector<int64_t>& widths, int64_t W, int64_t page_bytes);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // No Python objects are touched inside, so other Python threads (the HTTP server) may run meanwhile.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("paged_attention", &paged_attention, "Attention of a flat query batch over a paged KV cache", nogil);
  m.def("tile_pairs_supported", &tile_pairs_supported, "Whether this build's tiled attention has a vdpbf16ps form");
  m.def("tile_f16_supported", &tile_f16_supported, "Whether this build's tiled attention has an fp16-products form "
        "for fp32 queries over a bf16 cache");
  m.def("write_kv", &write_kv, "Store keys/values at their cache slots (int8 cache: records, per 16 values an fp16 "
        "scale and min)", nogil);
  m.def("add_rms_norm", &add_rms_norm, "residual += x (if given), then RMSNorm(residual) * weight", nogil);
  m.def("silu_mul", &silu_mul, "SiLU(gate) * up over a fused [gate | up] projection", nogil);
  m.def("rotary_", &rotary_, "Rotary embedding in place, rotate-half convention", nogil);
  m.def("rotary_write_kv", &rotary_write_kv, "A fused qkv projection's q and k heads rotated in place, k and v stored "
        "at their cache slots; returns q, a view of qkv", nogil);
  m.def("top_k_logsumexp", &top_k_logsumexp, "Each row's k largest logits (values, ids) and its logsumexp", nogil);
  m.def("exact_logits", &exact_logits, "fp32 logits [S, k] of the token ids [S, k]: hidden [S, D] . weight[ids]",
        nogil);
  m.def("rescore_top_k", &rescore_top_k, "top_k_logsumexp's candidates in fp32 (exact_logits; -inf where values are) "
        "and the logsumexp with their rounded terms swapped for the exact ones: (exact, lse)", nogil);
  m.def("truncate_", &truncate_, "top-k then top-p (vLLM's rule) in place: -inf below each row's smallest kept "
        "logit (ties with it kept), found by selection rather than a sort; returns those thresholds (-inf: all kept)",
        nogil);
  m.def("draw_rows", &draw_rows, "One token per row drawn from softmax(logits) by inverse CDF at the row's uniform u; "
        "-inf and NaN logits are never drawn", nogil);
  m.def("int4_linear", &int4_linear, "x @ W.T for 4-bit GGUF weights (w = q * d + m per 32 inputs)", nogil);
  m.def("int4_linear_supported", &int4_linear_supported, "Whether this build has int4_linear's instructions");
  m.def("int4_linear_f32", &int4_linear_f32, "x @ W.T in fp32 for 4-bit GGUF weights (w = fma(q, d, m) per 32 "
        "inputs, bit for bit the loader's fp32 weights)", nogil);
  m.def("int4_linear_f32_supported", &int4_linear_f32_supported, "Whether this build has int4_linear_f32's "
        "instructions");
  m.def("int4_linear_f16", &int4_linear_f16, "x @ W.T for 4-bit GGUF weights with fp16 products, x and the output fp32 "
        "or bf16 (int4_linear_f32's layout; w_scale: the power of two that puts the weights below 1)", nogil);
  m.def("int4_linear_f16_supported", &int4_linear_f16_supported, "Whether this build has int4_linear_f16's "
        "instructions (AVX512-FP16)");
  m.def("int4_linear_q8", &int4_linear_q8, "x @ W.T for 4-bit GGUF weights against int8 activations (per 32 inputs; "
        "each row's 4 largest inputs exact), x and the output fp32 or bf16 (int4_linear_f32's layout)", nogil);
  m.def("int4_linear_q8_supported", &int4_linear_q8_supported, "Whether this build has int4_linear_q8's "
        "instructions (AVX512-VNNI, AVX512-VBMI)");
  namespace py = pybind11;
  m.def("quantize_rows_int8", &quantize_rows_int8, "Each row to int8 within +-qmax with its own scale (absmax / qmax)",
        py::arg("x"), py::arg("qmax") = 127, nogil);
  m.def("split_outliers_int8", &split_outliers_int8, "The E input channels largest over the rows (channels [E]), "
        "each row quantised without them (q, scale) and their values in fp32 (extra_x [M, E])", py::arg("x"),
        py::arg("E"), py::arg("qmax") = 127, nogil);
  m.def("dequantize_int32", &dequantize_int32, "out = acc * row_scale[:, None] * col_scale[None, :] (+ bias) "
        "(+ extra_x @ extra_w[extra_rows])", py::arg("acc"), py::arg("row_scale"), py::arg("col_scale"), py::arg("bias"),
        py::arg("out"), py::arg("extra_x") = py::none(), py::arg("extra_w") = py::none(),
        py::arg("extra_rows") = py::none(), nogil);
  m.def("int8_gemm", &int8_gemm, "out = (q @ W.T) * row_scale[:, None] * col_scale[None, :] (+ bias) (+ extra_x @ "
        "extra_w[extra_rows]) for an int8 weight packed for it (Int8Weight.pack); the raw int32 sums when out is int32",
        py::arg("q"), py::arg("packed"), py::arg("row_scale"), py::arg("col_scale"), py::arg("bias"), py::arg("out"),
        py::arg("extra_x") = py::none(), py::arg("extra_w") = py::none(), py::arg("extra_rows") = py::none(), nogil);
  m.def("bf16_gemm", &bf16_gemm, "x @ W.T in bf16 for a weight packed in panels of 64 columns (Bf16Weight.pack)",
        nogil);
  m.def("bf16_gemm_supported", &bf16_gemm_supported, "Whether this build has bf16_gemm's instructions");
  m.def("lora_sgmv", &lora_sgmv, "out[t] += B_slot (A_slot x[t]) for the tokens of each slot's segment (Punica's "
        "SGMV): tokens sorted by slot, starts [S + 1], slots [S], each slot's rank per projection; A and B read from "
        "pages (KV cache blocks) through each slot's page tables of addresses",
        nogil);
  m.def("int8_gemm_supported", &int8_gemm_supported, "Whether this build has int8_gemm's instructions");
  m.def("int8_gemm_input_max", &int8_gemm_input_max, "The largest |activation| int8_gemm takes here (127; 64 on AVX2 "
        "without VNNI)");
}

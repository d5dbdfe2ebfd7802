// Writing a step's keys and values into the paged KV cache: copied, rounded to bf16, or quantised into int8
// records (attention_common.h's row format), at the slots the block tables give.
#include <ATen/core/Tensor.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "exp2_poly.h"

namespace {

#include "attention_common.h"

#if defined(__AVX512F__)
static_assert(kKvGroup == 16, "quantize_row takes a group in one 16-float vector");

// 16 values as fp32 (a bf16 is the top half of an fp32).
inline __m512 load_group(const float* x) { return _mm512_loadu_ps(x); }
inline __m512 load_group(const at::BFloat16* x) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// One kv-head row of D values to an int8 record: per group, min and (max - min) / 255 rounded to fp16 first, so
// that the values are quantised against exactly the parameters stored. On AVX-512 a group is one vector: its
// min, max and 16 codes take a few instructions instead of a scalar loop each (the same operations, the same bytes).
template <typename T>
void quantize_row(const T* x, uint8_t* rec, int64_t D) {
  uint8_t* params = rec + D;
  for (int64_t g = 0; g < D; g += kKvGroup) {
#if defined(__AVX512F__)
    const __m512 v = load_group(x + g);
    const float lo = _mm512_reduce_min_ps(v), hi = _mm512_reduce_max_ps(v);
#else
    float lo = static_cast<float>(x[g]), hi = lo;
    for (int64_t i = g + 1; i < g + kKvGroup; ++i) {
      const float v = static_cast<float>(x[i]);
      lo = std::min(lo, v);
      hi = std::max(hi, v);
    }
#endif
    const at::Half sm[2] = {at::Half((hi - lo) / 255.0f), at::Half(lo)};
    std::memcpy(params + g / kKvGroup * sizeof(sm), sm, sizeof(sm));
    const float scale = static_cast<float>(sm[0]), mn = static_cast<float>(sm[1]);
    const float inv = scale > 0.0f ? 1.0f / scale : 0.0f;
#if defined(__AVX512F__)
    __m512 q = _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(mn)), _mm512_set1_ps(inv));
    q = _mm512_roundscale_ps(q, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    q = _mm512_min_ps(_mm512_max_ps(q, _mm512_setzero_ps()), _mm512_set1_ps(255.0f));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(rec + g), _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q)));
#else
    for (int64_t i = g; i < g + kKvGroup; ++i) {
      const float qv = std::nearbyint((static_cast<float>(x[i]) - mn) * inv);
      rec[i] = static_cast<uint8_t>(std::clamp(qv, 0.0f, 255.0f));
    }
#endif
  }
}

// n fp32 values to bf16, rounded to nearest even exactly as torch's .to(torch.bfloat16) does (its vectorised
// conversion: NaN becomes 0xFFFF; c10's scalar one, used for a tail: 0x7FC0).
inline void row_to_bf16(const float* src, at::BFloat16* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i bias = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1), nan = _mm512_set1_epi32(0xFFFF);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(src + i);
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), one);
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, bias), lsb), 16);
    const __m512i b = _mm512_mask_blend_epi32(_mm512_cmp_ps_mask(x, x, _CMP_ORD_Q), nan, r);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), _mm512_cvtepi32_epi16(b));
  }
#endif
  for (; i < n; ++i) dst[i] = at::BFloat16(src[i]);
}

// The rows of x [T, KVH, D] (last dim contiguous) to their slots of the cache: copied (same dtype), rounded (fp32
// into bf16), or quantised into int8 records (uint8 cache).
template <typename T, typename C>
void store_rows(const at::Tensor& x, at::Tensor& cache, const int64_t* slots) {
  const int64_t T_ = x.size(0), KVH = x.size(1), D = x.size(2), RL = cache.size(3);
  const T* src = x.data_ptr<T>();
  C* dst = cache.data_ptr<C>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, T_, 64, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int64_t h = 0; h < KVH; ++h) {
        C* rec = dst + (slots[t] * KVH + h) * RL;
        if constexpr (std::is_same_v<C, uint8_t>)
          quantize_row(src + t * s0 + h * s1, rec, D);
        else if constexpr (!std::is_same_v<C, T>)
          row_to_bf16(src + t * s0 + h * s1, rec, D);
        else
          std::memcpy(rec, src + t * s0 + h * s1, D * sizeof(T));
      }
  });
}

}  // namespace

// Stores the step's keys and values [T, num_kv_heads, head_dim] (last dim contiguous) at their cache slots
// (block_id * block_size + offset), in place: copied into a float32 / bfloat16 cache of their own dtype, rounded
// into a bfloat16 one (float32 keys and values), quantised into an int8 (uint8 records) one.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.dim() == 3 && k.sizes() == v.sizes() && k.stride(2) == 1 && v.stride(2) == 1,
              "k and v must be [T, num_kv_heads, head_dim] with a contiguous last dimension");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "k and v must be float32 or bfloat16");
  const bool int8_cache = k_cache.scalar_type() == at::kByte;
  const bool to_bf16 = k.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kBFloat16;
  TORCH_CHECK(k_cache.scalar_type() == v_cache.scalar_type() &&
                  (int8_cache || to_bf16 || k_cache.scalar_type() == k.scalar_type()),
              "the cache must be k's dtype, bfloat16 (for float32 k), or uint8 (int8 records)");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, num_kv_heads, row]");
  const int64_t T = k.size(0), KVH = k.size(1), D = k.size(2);
  TORCH_CHECK(k_cache.size(2) == KVH && (int8_cache ? D % kKvGroup == 0 && k_cache.size(3) == row_len<uint8_t>(D)
                                                    : k_cache.size(3) == D),
              "cache rows do not match k's heads and head_dim");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() && slot_mapping.numel() == T,
              "slot_mapping must be T contiguous int64");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range");
  if (k.scalar_type() == at::kFloat) {
    if (int8_cache) {
      store_rows<float, uint8_t>(k, k_cache, slots);
      store_rows<float, uint8_t>(v, v_cache, slots);
    } else if (to_bf16) {
      store_rows<float, at::BFloat16>(k, k_cache, slots);
      store_rows<float, at::BFloat16>(v, v_cache, slots);
    } else {
      store_rows<float, float>(k, k_cache, slots);
      store_rows<float, float>(v, v_cache, slots);
    }
  } else if (int8_cache) {
    store_rows<at::BFloat16, uint8_t>(k, k_cache, slots);
    store_rows<at::BFloat16, uint8_t>(v, v_cache, slots);
  } else {
    store_rows<at::BFloat16, at::BFloat16>(k, k_cache, slots);
    store_rows<at::BFloat16, at::BFloat16>(v, v_cache, slots);
  }
}

void rotary_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions);

// A layer's fused projection qkv [T, (QH + 2 KVH) * D] after its matmul: q's and k's heads rotated in place (one
// rotary pass over both), k and v stored at their cache slots; returns q [T, QH, D], a view of qkv. One call where the
// Python split and views alone took 10.8 us a layer at one row (AMD EPYC Zen 4).
at::Tensor rotary_write_kv(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, const at::Tensor& positions,
                           at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& slot_mapping, int64_t q_heads,
                           int64_t kv_heads) {
  const int64_t heads = q_heads + 2 * kv_heads;
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && q_heads > 0 && kv_heads > 0 && qkv.size(1) % heads == 0,
              "qkv must be [T, (q_heads + 2 kv_heads) * head_dim] with contiguous rows");
  at::Tensor split = qkv.view({qkv.size(0), heads, qkv.size(1) / heads});
  at::Tensor qk = split.narrow(1, 0, q_heads + kv_heads);
  rotary_(qk, cos, sin, positions);
  write_kv(split.narrow(1, q_heads, kv_heads), split.narrow(1, q_heads + kv_heads, kv_heads), k_cache, v_cache,
           slot_mapping);
  return split.narrow(1, 0, q_heads);
}

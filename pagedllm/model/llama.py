"""The Llama-family decoder (Llama, SmolLM, TinyLlama, Mistral, Qwen2) over a flat, unpadded batch and a paged cache."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from pagedllm.model import kernels
from pagedllm.model.attention import STATIC_ROUTE, AttentionRoute, StepAttention, rotate_and_store
from pagedllm.model.layers import (
    Bf16Weight,
    Int4Weight,
    Int8Weight,
    PackedWeight,
    RotaryEmbedding,
    add_rms_norm,
    linear,
    swiglu,
)
from pagedllm.model.loader import ModelConfig, Q4Weight
from pagedllm.model.lora import LoRABatch, LoRAStack
from pagedllm.model.sampler import GrammarMask, apply_grammar_mask_
from pagedllm.model.timing import NO_TIMER, PartTimer

if TYPE_CHECKING:
    from pagedllm.model.dispatch import KernelTable, PlannedForms

# input channels of the int8 lm_head computed from the plain weight (Int8Weight.mm); 16 of 576 here brought its top-5
# logprob error from 1.17-1.26x plain bf16's to about 1x (`python docs/scripts/outlier_channels_gate.py`)
LM_HEAD_OUTLIER_CHANNELS = 16
INT8_FORMS = frozenset({"int8", "int8_mm"})  # dispatch's names of Int8Weight's products
# ... and of Int4Weight's (its fp32 or bf16 kernel; fp16 products; int8 activations)
INT4_FORMS = frozenset({"int4", "int4_f16", "int4_q8"})
# each matmul kind of a decoder layer: its checkpoint weights, stacked by rows in this order
MATMULS = {"qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
           "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
RESCORE_TOP_K = 16  # candidates whose logits are recomputed in fp32 when the model runs in bf16


@dataclass
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each sequence attends to."""

    slot_mapping: torch.Tensor  # int64 [T]
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    context_lens: torch.Tensor  # int32 [S], tokens in the cache after this step
    query_start_loc: torch.Tensor  # int32 [S + 1]
    max_query_len: int


Weight = torch.Tensor | PackedWeight


@dataclass
class ForwardOps:
    """The functions a forward calls, held per model, so that a timer (bench latency) hands it timed ones."""

    linear: Callable[..., torch.Tensor]
    rotary_kv: Callable[..., torch.Tensor]
    attention: Callable[..., torch.Tensor]
    add_rms_norm: Callable[..., torch.Tensor]
    swiglu: Callable[..., torch.Tensor]


@dataclass
class DecoderLayer:
    input_norm: torch.Tensor
    qkv_weight: Weight  # q, k and v projections fused into one matmul
    qkv_bias: torch.Tensor | None
    o_weight: Weight
    post_norm: torch.Tensor
    gate_up_weight: Weight  # gate and up projections fused
    down_weight: Weight


class Consumed:
    """The loader's weights, taken one by one in the model's dtype: each leaves the dict (and, its last holder gone,
    memory) as its layer is built, so a checkpoint's plain weights and their packed forms are never all held at once.
    A GGUF's 4-bit weights (`q4`) give their dense rows only when taken, where a form needs them."""

    def __init__(self, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 q4: dict[str, Q4Weight] | None = None) -> None:
        self.weights = weights
        self.dtype = dtype
        self.q4 = q4 if q4 is not None else {}

    def __contains__(self, name: str) -> bool:
        return name in self.weights or name in self.q4

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.weights[name].shape) if name in self.weights else tuple(self.q4[name].q.shape)

    def _take(self, name: str) -> torch.Tensor:
        return self.weights.pop(name) if name in self.weights else self.q4.pop(name).values()

    def pop(self, name: str) -> torch.Tensor:
        """For a weight built into other forms: it may still share the loader's memory."""
        return self._take(name).to(self.dtype).contiguous()

    def keep(self, name: str) -> torch.Tensor:
        """For a tensor the model holds: in its own memory, since one read from a mapped file (safetensors) keeps the
        whole mapping, with every page the build read, resident for as long as it lives."""
        stored = self._take(name)
        tensor = stored.to(self.dtype).contiguous()
        return tensor.clone() if tensor.data_ptr() == stored.data_ptr() else tensor

    def drop(self, names: list[str]) -> None:
        """Names whose dense rows no form needs: out of both dicts, never made."""
        for name in names:
            self.weights.pop(name, None)
            self.q4.pop(name, None)


class LlamaModel:
    """Weights held as plain tensors; forward is a function of the batch and the KV cache, nothing else. Takes the
    loader's `weights` and `q4_weights` dicts: they are emptied as the layers are built (`Consumed`)."""

    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 attention_backend: str = "auto", q4_weights: dict[str, Q4Weight] | None = None,
                 int8: Collection[str] = (), planned: Mapping[str, PlannedForms] | None = None,
                 f16: bool = False, q8: bool = False) -> None:
        self.config = config
        self.dtype = dtype
        self.attention_backend = attention_backend
        self.attention_route: AttentionRoute = STATIC_ROUTE  # the runner sets the one measured here
        self.kernel_table: KernelTable | None = None  # the matmuls' measured table, where one was (model/dispatch.py)
        self.q_size = config.num_attention_heads * config.head_dim
        self.kv_size = config.num_key_value_heads * config.head_dim
        self.scale = config.head_dim ** -0.5
        q4 = q4_weights if q4_weights is not None else {}  # a GGUF file's 4-bit weights, consumed as `weights`
        w = Consumed(weights, dtype, q4)
        self.pack = attention_backend != "reference" and PackedWeight.available(dtype)
        # The C++ kernels (fused norm/rotary/SwiGLU, int4 matmul), except on the reference path (the torch oracle).
        self.ext = kernels.load() if attention_backend != "reference" else None
        # the matmuls (of INT8_MATMULS) that run w8a8 in the steps the int4 kernel leaves
        self.int8 = frozenset(int8) if self.pack and self.ext is not None else frozenset()
        # the 4-bit weights may also run with fp16 products (Int4Weight.mm_f16) or against int8 activations (mm_q8)
        # where the engine allows them (f16, q8) and their kernel is built here
        self.f16 = self.pack and f16 and Int4Weight.f16_available(dtype, self.ext)
        self.q8 = self.pack and q8 and Int4Weight.q8_available(dtype, self.ext)
        # the forms the cached kernel table's routes take (dispatch.planned_forms), if it was measured for these weights
        self.planned = planned if planned and self.pack and self._plan_fits(w, planned) else {}
        self.embed = w.keep("model.embed_tokens.weight")
        self.lm_head = w.keep("lm_head.weight") if "lm_head.weight" in w else self.embed
        self.lm_head_weight = self._packed(self.lm_head, "lm_head") if self.pack else self.lm_head
        self._logits_buffer: torch.Tensor | None = None  # top_logits' logits, kept across steps (_scratch_logits)
        self.norm = w.keep("model.norm.weight")
        self.layers = [self._layer(w, i) for i in range(config.num_hidden_layers)]
        self.rotary = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                      config.rope_scaling, dtype)
        self.lora: LoRAStack | None = None  # the resident adapters' weights (set by the runner with --enable-lora)
        self.set_timer(NO_TIMER)

    def set_timer(self, timer: PartTimer) -> None:
        """Run the forward's kernels as `timer`'s parts; NO_TIMER gives the plain functions back."""
        t = timer.timed
        self.ops = ForwardOps(t("linear", linear), t("rotary_kv", rotate_and_store),
                              t("attention", StepAttention.__call__), t("norm", add_rms_norm), t("activation", swiglu))

    def _layer(self, w: Consumed, i: int) -> DecoderLayer:
        p = f"model.layers.{i}."
        names = {kind: [f"{p}{n}.weight" for n in parts] for kind, parts in MATMULS.items()}
        bias = torch.cat([w.pop(p + n + ".bias") for n in MATMULS["qkv"]]) if self.config.attention_bias else None
        return DecoderLayer(
            input_norm=w.keep(p + "input_layernorm.weight"),
            qkv_weight=self._weight(w, names["qkv"], "qkv"),
            qkv_bias=bias,
            o_weight=self._weight(w, names["o"], "o"),
            post_norm=w.keep(p + "post_attention_layernorm.weight"),
            gate_up_weight=self._weight(w, names["gate_up"], "gate_up"),
            down_weight=self._weight(w, names["down"], "down"),
        )

    def _weight(self, w: Consumed, names: list[str], kind: str) -> Weight:
        """The named weights stacked by rows into one matmul: packed for oneDNN, with their 4-bit form when the
        checkpoint has one for each; plain torch on the reference path."""
        if not self.pack:
            return torch.cat([w.pop(n) for n in names]) if len(names) > 1 else w.keep(names[0])
        parts = self._int4_parts([w.q4[n] for n in names if n in w.q4], len(names))
        shape = (sum(w.shape(n)[0] for n in names), w.shape(names[0])[1])
        forms = self.possible_forms(shape, kind, parts is not None)
        make = self._forms_to_make(kind, PackedWeight.shape_entry(shape, forms), forms)
        if make <= INT4_FORMS and not PackedWeight.widens(self.dtype):  # the 4-bit kernels alone read no dense rows
            w.drop(names)
            return self._packed(torch.empty(shape, dtype=self.dtype, device="meta"), kind, parts, make)
        kept = PackedWeight.widens(self.dtype)  # the plain rows are what the model holds
        plain = torch.cat([w.pop(n) for n in names]) if len(names) > 1 else (w.keep if kept else w.pop)(names[0])
        w.drop(names)
        return self._packed(plain, kind, parts, make)

    def _int4_parts(self, stored: list[Q4Weight], wanted: int) -> tuple[torch.Tensor, ...] | None:
        """The 4-bit parts of a stacked weight (values, scales, mins), if each of its `wanted` weights has them and
        a kernel takes them here."""
        if not stored or len(stored) < wanted:
            return None
        q, scale, min_ = (torch.cat([getattr(s, f) for s in stored]) for f in ("q", "scale", "min"))
        return (q, scale, min_) if Int4Weight.available(q, scale, min_, self.dtype, self.ext) else None

    def _plan_fits(self, w: Consumed, planned: Mapping[str, PlannedForms]) -> bool:
        """Each kind's first weight has the entry the cached table was measured for, so the engine reads that table
        after the build: a build for a table of other shapes would lack forms its own measurement needs."""
        names = {kind: [f"model.layers.0.{n}.weight" for n in parts] for kind, parts in MATMULS.items()}
        names["lm_head"] = ["lm_head.weight" if "lm_head.weight" in w else "model.embed_tokens.weight"]
        for kind, found in names.items():
            if kind not in planned or any(n not in w for n in found):
                return False
            shape = (sum(w.shape(n)[0] for n in found), w.shape(found[0])[1])
            stored = [w.q4[n] for n in found if n in w.q4]
            int4 = kind != "lm_head" and self._int4_parts(stored, len(found)) is not None
            if planned[kind].entry != PackedWeight.shape_entry(shape, self.possible_forms(shape, kind, int4)):
                return False
        return True

    def _packed(self, plain: torch.Tensor, kind: str, q4: tuple[torch.Tensor, ...] | None = None,
                make: frozenset[str] | None = None) -> PackedWeight:
        """The weight with each form it can have here, or only those its cached route takes (`make`, if known)."""
        forms = self.possible_forms(tuple(plain.shape), kind, q4 is not None)
        make = self._forms_to_make(kind, PackedWeight.shape_entry(tuple(plain.shape), forms), forms) \
            if make is None else make
        outliers = LM_HEAD_OUTLIER_CHANNELS if kind == "lm_head" else 0
        int8 = Int8Weight(plain, self.ext, outliers=outliers, int_mm="int8_mm" in make) if make & INT8_FORMS else None
        bf16 = Bf16Weight(plain, self.ext) if "bf16_gemm" in make else None
        int4 = Int4Weight(*q4, self.ext, self.dtype, f16="int4_f16" in make, own="int4" in make,
                          q8="int4_q8" in make) \
            if make & INT4_FORMS else None
        weight = PackedWeight(plain, int4, int8, bf16, onednn="onednn" in make)
        weight.skipped = forms - weight.paths()
        return weight

    def possible_forms(self, shape: tuple[int, ...], kind: str, int4: bool) -> frozenset[str]:
        """dispatch's names of the forms a weight of this shape and kind can have here (its paths() when all are
        made; `int4`: it has 4-bit parts a kernel takes)."""
        f16 = int4 and self.f16 and Int4Weight.f16_available(self.dtype, self.ext, shape[0])
        q8 = int4 and self.q8 and Int4Weight.q8_available(self.dtype, self.ext, shape[0])
        forms = {"onednn", *(["int4"] if int4 else []), *(["int4_f16"] if f16 else []), *(["int4_q8"] if q8 else []),
                 *(["bf16_plain"] if PackedWeight.widens(self.dtype) else [])}
        if kind in self.int8:
            forms |= Int8Weight.forms_for(self.ext, shape[1], int_mm=True)
        if kind != "lm_head" and Bf16Weight.available(torch.empty(shape, dtype=self.dtype, device="meta"), self.ext):
            forms.add("bf16_gemm")
        return frozenset(forms)

    def _forms_to_make(self, kind: str, entry: str, forms: frozenset[str]) -> frozenset[str]:
        """Those of `forms` the cached table's route for this kind takes, if it was measured for this very weight
        (its entry); else all of them, to be measured."""
        plan = self.planned.get(kind)
        if plan is None or plan.entry != entry or not plan.taken & forms:
            return forms
        return plan.taken & forms

    @property
    def exact_logits(self) -> bool:
        """fp32 with an fp32 lm_head: no candidate needs rescoring (int8 lm_head steps in fp32 do, as bf16's)."""
        lm_head = self.lm_head_weight
        return self.dtype == torch.float32 and not (isinstance(lm_head, PackedWeight) and lm_head.int8 is not None)

    def packed_weights(self) -> dict[str, list[PackedWeight]]:
        """Every packed weight by matmul kind (qkv, o, gate_up, down, lm_head): what model/dispatch.py routes."""
        kinds = {"qkv": "qkv_weight", "o": "o_weight", "gate_up": "gate_up_weight", "down": "down_weight"}
        found = {kind: [getattr(layer, attr) for layer in self.layers] for kind, attr in kinds.items()}
        found["lm_head"] = [self.lm_head_weight]
        return {kind: ws for kind, ws in found.items() if all(isinstance(w, PackedWeight) for w in ws)}

    @property
    def num_int4_matmuls(self) -> int:
        """Layer matmuls that have a 4-bit form for small batches."""
        return sum(isinstance(x, PackedWeight) and x.int4 is not None for layer in self.layers
                   for x in (layer.qkv_weight, layer.o_weight, layer.gate_up_weight, layer.down_weight))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]], lora: LoRABatch | None = None) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm, for every token of the step; `lora`: the step's tokens
        by adapter slot (None: no token has an adapter, and no LoRA op runs)."""
        eps, ext, ops = self.config.rms_norm_eps, self.ext, self.ops
        residual = F.embedding(input_ids, self.embed)  # the residual stream, updated in place
        delta = None  # what the previous sublayer adds to it
        attention = StepAttention.build(self.dtype, self.config.head_dim, kv_caches[0][0], meta.block_tables,
                                        meta.context_lens, meta.query_start_loc, self.scale, meta.max_query_len,
                                        self.attention_backend, self.attention_route)
        for i, (layer, (k_cache, v_cache)) in enumerate(zip(self.layers, kv_caches)):
            x = ops.add_rms_norm(delta, residual, layer.input_norm, eps, ext)
            delta = self._attention(i, layer, x, positions, meta, attention, k_cache, v_cache, lora)
            x = ops.add_rms_norm(delta, residual, layer.post_norm, eps, ext)
            h = ops.swiglu(self._linear(x, layer.gate_up_weight, None, i, "gate_up", lora), ext)
            delta = self._linear(h, layer.down_weight, None, i, "down", lora)
        return ops.add_rms_norm(delta, residual, self.norm, eps, ext)

    def _linear(self, x: torch.Tensor, weight: Weight, bias: torch.Tensor | None, layer: int, kind: str,
                lora: LoRABatch | None) -> torch.Tensor:
        """A layer's matmul, plus its adapters' deltas when the step has any."""
        out = self.ops.linear(x, weight, bias)
        if lora is None or self.lora is None or kind not in lora.kinds:
            return out
        return self.lora.add_delta(out, x, layer, kind, lora)

    def _attention(self, i: int, layer: DecoderLayer, x: torch.Tensor, positions: torch.Tensor,
                   meta: AttentionMetadata, attention: StepAttention, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   lora: LoRABatch | None) -> torch.Tensor:
        c, ops = self.config, self.ops
        qkv = self._linear(x, layer.qkv_weight, layer.qkv_bias, i, "qkv", lora)
        q = ops.rotary_kv(qkv, positions, self.rotary, k_cache, v_cache, meta.slot_mapping, c.num_attention_heads,
                          c.num_key_value_heads, self.ext)
        o = ops.attention(attention, q, k_cache, v_cache)
        return self._linear(o.reshape(-1, self.q_size), layer.o_weight, None, i, "o", lora)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits [S, vocab]. In bf16 the lm_head's output is rounded to steps of 0.125 near typical logit
        sizes, enough to tie or swap the top candidates, so the top few are recomputed in fp32 (S x k dot products)."""
        logits = linear(hidden, self.lm_head_weight).float()
        if self.exact_logits:
            return logits
        k = min(RESCORE_TOP_K, logits.shape[-1])
        # the kernels' one pass finds the candidates in a third of torch's topk time (64 rows, Zen 4: 0.9 vs 2.9 ms)
        top = logits.topk(k, dim=-1).indices if self.ext is None else self.ext.top_k_logsumexp(logits, k)[1]
        return logits.scatter_(1, top, self._exact_logits(hidden, top))

    def top_logits(self, hidden: torch.Tensor, grammar: GrammarMask | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """What greedy decoding needs of compute_logits' output, without making it: each row's top candidates
        (fp32 values [S, k], ids [S, k]) and its logsumexp [S], from one C++ pass over the model-dtype logits;
        with a grammar, over the tokens it allows (-inf elsewhere), as `sample` masks."""
        assert self.ext is not None, "top_logits needs the C++ kernels"
        logits = self._scratch_logits(hidden)
        if grammar is not None:
            apply_grammar_mask_(logits, grammar)
        values, ids, lse = self.ext.top_k_logsumexp(logits, min(RESCORE_TOP_K, logits.shape[-1]))
        if self.exact_logits:
            return values, ids, lse
        # The candidates in fp32 and the logsumexp with their rounded terms swapped for the exact ones, in one C++
        # pass (a gather, an einsum and eight torch ops took 0.59 ms of a 1-row logits pass of 2.2 ms, Zen 4).
        exact, lse = self.ext.rescore_top_k(hidden.contiguous(), self.lm_head, values, ids, lse)
        return exact, ids, lse

    def _scratch_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The lm_head's logits for top_logits, which reads them once: written into a buffer kept across steps where
        the matmul's path takes one. A fresh [rows, vocab] tensor past glibc's 32 MiB mmap threshold (fp32 logits of
        171+ rows here) is mapped afresh at every step and its pages faulted in: 11-14 thousand faults a step at
        200-256 rows on Zen 3 (docs/performance.md)."""
        weight, rows = self.lm_head_weight, hidden.shape[0]
        if not isinstance(weight, PackedWeight) or weight.path_for(rows) not in INT8_FORMS:
            return linear(hidden, weight)  # no buffer where the path makes its own output
        buffer = self._logits_buffer
        if buffer is None or buffer.shape[0] < rows or buffer.dtype != hidden.dtype:
            buffer = self._logits_buffer = hidden.new_empty(-(-rows // 64) * 64, self.lm_head.shape[0])
        return weight.mm(hidden, out=buffer[:rows])

    def _exact_logits(self, hidden: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """fp32 logits [S, k] of the token ids [S, k]: the C++ pass top_logits' rescoring makes (the same values), or
        without the kernels a gather and an einsum (index_select: advanced indexing took 4-6x longer here)."""
        if self.ext is not None:
            return self.ext.exact_logits(hidden.contiguous(), self.lm_head, ids.contiguous())
        rows = self.lm_head.index_select(0, ids.reshape(-1)).view(*ids.shape, -1)
        return torch.einsum("sd,skd->sk", hidden.float(), rows.float())

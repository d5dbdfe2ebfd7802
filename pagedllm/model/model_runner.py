"""Turns a step's plan into one flat, unpadded batch, runs the model over the paged cache and samples."""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Collection, Hashable
from itertools import chain

import numpy as np
import torch

from pagedllm.config import EngineConfig
from pagedllm.core.plan import ScheduledSeq, SchedulerOutput
from pagedllm.core.sequence import Sequence
from pagedllm.errors import InvalidRequestError
from pagedllm.model import attention_dispatch, dispatch, heap, kernels, step_budget
from pagedllm.model.attention import is_fast_path_available, kv_record_len
from pagedllm.model.attention_dispatch import AttentionShape
from pagedllm.model.bf16_choice import torch_dtype_name
from pagedllm.model.layers import Int4Weight
from pagedllm.model.llama import AttentionMetadata
from pagedllm.model.loader import LoadedModel, ModelConfig, load_model
from pagedllm.model.loader.peft import LoRAAdapter, LoRALoadError, load_peft_adapter
from pagedllm.model.lora import AdapterStore, LoRABatch, LoRAStack
from pagedllm.model.prefault import KVPrefault
from pagedllm.model.registry import CausalLM, model_class
from pagedllm.model.sampler import GrammarMask, SamplerOutput, SamplingBatch, sample, sample_greedy_from_top, seed_at
from pagedllm.model.step_budget import StepBudget
from pagedllm.model.threads import ThreadGovernor, start_threads
from pagedllm.model.timing import NO_TIMER, PartTimer
from pagedllm.model.tokenizer import Tokenizer

logger = logging.getLogger("pagedllm")

INT8_MATMULS = ("qkv", "o", "gate_up", "down", "lm_head")  # --quantization w8a8
# --quantization auto on a GGUF file with 4-bit weights: the matmuls whose int8 form passes the accuracy gate on the
# default model with room to spare (`pagedllm bench accuracy`): the lm_head, whose top candidates are rescored in
# fp32 anyway. With per-token activation scales the others miss it: o_proj by a hair, qkv / gate_up / down by
# 2.5-3x, SmoothQuant-calibrated too (docs/performance.md).
INT8_DEFAULT = ("lm_head",)

ONEDNN_PRIMITIVE_CACHE_CAPACITY = 32  # matmul shapes oneDNN keeps ready (see from_config)


def kernel_variant(config: EngineConfig) -> str:
    """The engine flags that choose the forms of the model's weights: part of the kernel table's key, known before
    the model is built (model/dispatch.py)."""
    return f"quantization={config.quantization} backend={config.attention_backend} dtype={config.dtype}"


def int8_matmuls(config: EngineConfig, dtype: torch.dtype, has_4bit: bool) -> tuple[str, ...]:
    """The matmuls that run w8a8 where the int4 kernel leaves them: all with --quantization w8a8; by default the
    lm_head, in a bf16 model from a 4-bit file or where dispatch.auto_fp32 says; none without an exact int8 product."""
    int8 = INT8_MATMULS if config.quantization == "w8a8" else INT8_DEFAULT if (config.quantization == "auto" and (
        (has_4bit and dtype == torch.bfloat16) or dispatch.auto_fp32(config.dtype, dtype))) else ()
    if int8 and not kernels.int8_available():  # no exact int8 product here: no int8 at all
        if config.quantization == "w8a8":
            raise ValueError("--quantization w8a8 needs pagedllm's C++ kernels on a CPU with AVX2 (or VNNI, AMX):"
                             " without them int8 products saturate")
        return ()
    return int8


def fp16_tiles(config: EngineConfig, dtype: torch.dtype) -> bool:
    """The prompts' attention may run with fp16 products (AVX512-FP16: twice fp32's multiply-adds per instruction;
    each lane's fp16 sum takes at most 48 products before fp32 does) where `--dtype auto` chose fp32 and quantization
    is left to the engine; the measured dispatch takes them where they are faster. An explicit float32 (or int4) stays
    exact; bf16 queries keep their own forms (fp16 tiles had 1.12x vdpbf16ps's error: docs/performance-log.md)."""
    return config.quantization == "auto" and dispatch.auto_fp32(config.dtype, dtype)


def fp16_products(config: EngineConfig, dtype: torch.dtype) -> bool:
    """The 4-bit weights may run with fp16 products (each lane's fp16 sum 32 products long) where fp16_tiles allows
    them, and in a bf16 model with quantization left to the engine, whose own products round weights and activations
    to bf16's 8 bits (fp16 keeps 11); the measured dispatch takes them where they are faster."""
    return fp16_tiles(config, dtype) or (config.quantization == "auto" and dtype == torch.bfloat16)


def int8_activations(config: EngineConfig, dtype: torch.dtype) -> bool:
    """The 4-bit weights may run against int8 activations (per 32 inputs, each row's 4 largest exact) where
    `--dtype auto` chose fp32 and quantization is left to the engine: 0.71-0.85x plain bf16's error at the accuracy
    gate.
    In a bf16 model their error adds to bf16's own rounding, 1.11-1.39x plain bf16's: at the gate's edge, so not
    there (docs/performance-log.md, 2026-12-01)."""
    return fp16_tiles(config, dtype)


def attention_shape(config: EngineConfig, model: ModelConfig, dtype: torch.dtype, kv_dtype: torch.dtype
                    ) -> AttentionShape:
    """What the attention dispatch measures for this engine: the model's heads, the dtypes, whether fp16 products
    are allowed."""
    return AttentionShape.of(model, dtype, kv_dtype, config.block_size, f16=fp16_tiles(config, dtype))


def kv_row_shape(config: ModelConfig, kv_dtype: torch.dtype) -> tuple[int, int]:
    """One token's K (or V) in one layer's cache: [num_kv_heads, head_dim], or int8 records (uint8)."""
    row = kv_record_len(config.head_dim) if kv_dtype == torch.uint8 else config.head_dim
    return config.num_key_value_heads, row


def kv_bytes_per_block(config: ModelConfig, block_size: int, kv_dtype: torch.dtype) -> int:
    """K and V for every layer of one block."""
    heads, row = kv_row_shape(config, kv_dtype)
    return 2 * config.num_hidden_layers * block_size * heads * row * torch.tensor([], dtype=kv_dtype).element_size()


class ModelRunner:
    """Owns the model, the KV cache tensors and the random generators; knows nothing of policy."""

    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, eos_token_ids: Collection[int],
                 seed: int = 0, kv_dtype: torch.dtype | None = None) -> None:
        c = model.config
        self.model = model
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.eos_token_ids = tuple(eos_token_ids)
        self.rng = torch.Generator().manual_seed(seed)  # unseeded requests draw from this, not torch's global one
        self.kv_dtype = kv_dtype or model.dtype
        shape = (num_blocks, block_size, *kv_row_shape(c, self.kv_dtype))
        # Uninitialised: attention reads only slots written before it (tests fill the pool with NaN to check), and
        # zeroing GiBs up front costs seconds of page faults at start-up; pages now fault in as blocks are first used.
        self.kv_caches = [(torch.empty(shape, dtype=self.kv_dtype), torch.empty(shape, dtype=self.kv_dtype))
                          for _ in range(c.num_hidden_layers)]
        self.prefault = KVPrefault([t for pair in self.kv_caches for t in pair])  # mapped in the background
        self.seeds: dict[Hashable, int] = {}  # seeded sequences' seeds (seed + index of the sample)
        self.timer: PartTimer = NO_TIMER
        self.governor: ThreadGovernor | None = None  # the thread count follows the CPUs others leave us
        if model.lora is not None:
            model.lora.bind(self.kv_caches)  # resident adapters' weights are written into blocks of this pool
        own = weakref.proxy(self)  # a bound method here was a cycle: the runner, its model and KV pool lived until gc
        self.adapters = AdapterStore(lambda path: own.read_adapter(path))  # each LoRA adapter's folder and CPU copy
        self.adapter_slots: dict[int, int] = {}  # resident adapter -> its slot in model.lora

    def set_timer(self, timer: PartTimer) -> None:
        """Run the step's parts (and the model's kernels) as `timer`'s parts; NO_TIMER turns timing off."""
        self.timer = timer
        self.model.set_timer(timer)

    @classmethod
    def from_config(cls, config: EngineConfig) -> tuple[ModelRunner, Tokenizer, str]:
        """Load the checkpoint, size the KV pool from the memory budget and build the kernels now, not on a request;
        the runner, the checkpoint's tokenizer and its name. Sets torch's threads: this process computes with them."""
        governor = start_threads(config.threads)
        dtype = getattr(torch, torch_dtype_name(config))
        # bf16: the file's 4-bit weights (and with them the int8 lm_head below) as before; fp32: only for its kernel
        keep_4bit = config.quantization != "none" and config.attention_backend != "reference" and (
            dtype == torch.bfloat16 or Int4Weight.kernel_available(dtype, kernels.load()))
        with heap.build_in_heap():  # the load's and the build's temporaries reuse the memory freed before them
            loaded = load_model(config.model, dtype, keep_4bit=keep_4bit)
            kv_dtype = getattr(torch, config.kv_cache_torch_dtype_name)
            num_blocks = config.num_blocks or config.kv_cache_bytes // kv_bytes_per_block(
                loaded.config, config.block_size, kv_dtype)
            if num_blocks < 1:
                raise ValueError(f"kv_cache_memory {config.kv_cache_memory!r} holds no block of "
                                 f"{config.block_size} tokens")
            checkpoint_bytes = loaded.nbytes()  # before the build consumes the loader's tensors
            model = cls.build_model(config, loaded, dtype, kv_dtype)
        heap.trim_after_build(checkpoint_bytes)  # the loader's plain weights and the forms no route takes: freed
        eos = set(loaded.config.eos_token_ids) | ({loaded.tokenizer.eos_token_id} - {None})
        # which form each batch size takes is the kernels line's (dispatch.tune), not a fixed cut-off
        logger.info("loaded %s (%s, %d matmuls with 4-bit weights%s, int8 allowed for: %s), %d KV blocks of %d "
                    "tokens (%s)", loaded.name, torch_dtype_name(config), model.num_int4_matmuls,
                    "".join(f" ({what} allowed)" for what, on in (("fp16 products", model.f16),
                                                                   ("int8 activations", model.q8)) if on),
                    ", ".join(sorted(model.int8)) or "none",
                    num_blocks, config.block_size, "int8" if kv_dtype == torch.uint8 else kv_dtype)
        if config.enable_lora:
            model.lora = LoRAStack(loaded.config, config.max_loras, config.max_lora_rank, dtype, model.ext)
        runner = cls(model, num_blocks, config.block_size, eos, config.seed, kv_dtype)
        runner.governor = governor
        runner.adapters.capacity = config.max_cpu_loras
        return runner, loaded.tokenizer, loaded.name

    @staticmethod
    def build_model(config: EngineConfig, loaded: LoadedModel, dtype: torch.dtype, kv_dtype: torch.dtype) -> CausalLM:
        """The model from the loader's tensors (consumed), each matmul's and attention's kernel measured here."""
        int8 = int8_matmuls(config, dtype, bool(loaded.q4_weights))
        if config.attention_backend != "reference":
            is_fast_path_available()  # compile (or load the cached build of) the C++ kernels
        # oneDNN caches a primitive, with its own buffers, per matmul shape, 1,024 of them by default; every step
        # size is a new shape, so a server's RSS grew for as long as new sizes came (~0.2 MiB a request, soak test).
        # Read when oneDNN makes its first primitive (the build below): room for every bounded shape where the
        # measured dispatch chose them (re-creating primitives cost more than padding), else 32 (performance.md).
        variant = kernel_variant(config)
        os.environ.setdefault(dispatch.CAPACITY_ENV, str(dispatch.primitive_cache_capacity(
            ONEDNN_PRIMITIVE_CACHE_CAPACITY, dtype, loaded.name, variant)))
        build = model_class(loaded.config.architecture)  # the family's class, as the registry maps the checkpoint
        planned = dispatch.planned_forms(dtype, loaded.name, variant)  # the forms the cached routes take, or None
        model = build(loaded.config, loaded.weights, dtype, config.attention_backend, loaded.q4_weights, int8, planned,
                      f16=fp16_products(config, dtype), q8=int8_activations(config, dtype))
        model.kernel_table = dispatch.tune(model.packed_weights(), dtype, loaded.name, variant=variant)  # measured
        if model.ext is not None:  # which attention kernel each sequence takes, measured
            model.attention_route, _ = attention_dispatch.tune(attention_shape(config, loaded.config, dtype, kv_dtype))
        return model

    def step_budget(self) -> StepBudget:
        """The step's token budget for this machine and model, where the user set none (model/step_budget.py)."""
        return step_budget.choose(self.model.kernel_table, self.model.config.num_hidden_layers)

    @property
    def model_config(self) -> ModelConfig:
        return self.model.config

    # ---- LoRA adapters ----------------------------------------------------------------------------------------------
    def read_adapter(self, path: str) -> LoRAAdapter:
        """An adapter folder read and checked against this model (LoRALoadError if it cannot serve here); touches no
        state, so it may run on any thread."""
        if self.model.lora is None:
            raise LoRALoadError("LoRA adapters need enable_lora (--enable-lora)")
        return load_peft_adapter(path, self.model.config, self.model.lora.max_rank, self.model.dtype)

    def add_adapter(self, lora_int_id: int, adapter: LoRAAdapter, path: str) -> None:
        self.adapters.add(lora_int_id, adapter, path)

    def remove_adapter(self, lora_int_id: int) -> None:
        """Forget an adapter's weights (the scheduler has released its slot)."""
        self.adapters.remove(lora_int_id)
        self.adapter_slots.pop(lora_int_id, None)

    def adapter_blocks(self, adapter: LoRAAdapter) -> int:
        """KV blocks an adapter's weights fill in the pool (S-LoRA's unified paging): its paged layout's."""
        return self.model.lora.blocks_needed(adapter)

    def load_adapters(self, loads: list[tuple[int, int, tuple[int, ...]]]) -> None:
        """Write adapters into the blocks they hold and point their slots at them, before the step that first runs
        them."""
        for lora_int_id, slot, blocks in loads:
            self.adapter_slots = {a: s for a, s in self.adapter_slots.items() if s != slot}
            self.model.lora.load(slot, self.adapters.get(lora_int_id), list(blocks))
            self.adapter_slots[lora_int_id] = slot

    def lora_batch(self, scheduled: list[ScheduledSeq], lens: np.ndarray) -> LoRABatch | None:
        """The step's tokens by adapter slot; None when no sequence of the step has an adapter."""
        if self.model.lora is None or not any(s.seq.lora_int_id for s in scheduled):
            return None
        slots = [self.adapter_slots[s.seq.lora_int_id] if s.seq.lora_int_id else -1 for s in scheduled]
        kinds = frozenset().union(*(self.model.lora.kinds[slot] for slot in set(slots) - {-1}))
        return LoRABatch.build(torch.from_numpy(np.repeat(np.array(slots, dtype=np.int64), lens)), self.model.dtype,
                               kinds)

    def prepare(self, plan: SchedulerOutput,
                ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor, LoRABatch | None]:
        """input_ids, positions, attention metadata, the rows whose logits are sampled and the tokens by LoRA
        adapter, built once per step: in numpy, whose calls on these few-element arrays cost a fraction of torch's
        (one sequence 38 against 157 us; 64 with one core busy elsewhere 145 against 923 us; AMD EPYC Zen 4)."""
        scheduled, bs = plan.scheduled, self.block_size
        count = len(scheduled)
        starts = np.fromiter((s.start for s in scheduled), dtype=np.int64, count=count)
        lens = np.fromiter((s.num_new_tokens for s in scheduled), dtype=np.int64, count=count)
        input_ids = torch.tensor(list(chain.from_iterable(
            s.seq.token_ids[s.start:s.end] + s.draft if s.draft else s.seq.token_ids[s.start:s.end]
            for s in scheduled)), dtype=torch.int64)
        query_start_loc = np.zeros(count + 1, dtype=np.int64)
        np.cumsum(lens, out=query_start_loc[1:])
        seq_of_token = np.repeat(np.arange(count), lens)
        positions = np.arange(len(input_ids)) - query_start_loc[seq_of_token] + starts[seq_of_token]
        tables = [s.block_table for s in scheduled]
        padded = np.zeros((count, max(map(len, tables))), dtype=np.int32)
        for row, table in zip(padded, tables):
            row[:len(table)] = table
        slot_mapping = padded[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slot_mapping),
            block_tables=torch.from_numpy(padded),
            context_lens=torch.from_numpy((starts + lens).astype(np.int32)),
            query_start_loc=torch.from_numpy(query_start_loc.astype(np.int32)),
            max_query_len=int(lens.max()),
        )
        return (input_ids, torch.from_numpy(positions), meta, self.logit_rows(scheduled, query_start_loc),
                self.lora_batch(scheduled, lens))

    @staticmethod
    def logit_rows(scheduled: list[ScheduledSeq], query_start_loc: np.ndarray) -> torch.Tensor:
        """The hidden rows sampled, in plan order: a chunk's last row once per sampler (n at a group's first sample),
        and for a speculative decode its last 1 + len(draft) rows (the token after each proposed one)."""
        drafts = np.fromiter((len(s.draft) for s in scheduled), dtype=np.int64, count=len(scheduled))
        fan_out = np.fromiter((len(s.samplers) for s in scheduled), dtype=np.int64, count=len(scheduled)) + drafts
        rows = np.repeat(query_start_loc[1:] - 1, fan_out)
        if drafts.any():
            drafts = np.repeat(drafts, fan_out)
            first = np.repeat(np.cumsum(fan_out) - fan_out, fan_out)
            rows += np.where(drafts > 0, np.arange(len(rows)) - first - drafts, 0)
        return torch.from_numpy(rows)

    @torch.inference_mode()
    def execute(self, plan: SchedulerOutput, grammar: GrammarMask | None = None) -> SamplerOutput | None:
        """One model step; returns a token for each of the plan's sampling rows, in order (None if none sample).
        `grammar`: the tokens allowed on the structured-output rows (masked before greedy's top candidates, or before
        sampling)."""
        timer = self.timer
        if self.governor is not None:
            self.governor.tick()
        self.copy_blocks(plan.copies)
        self.load_adapters(plan.lora_loads)
        with timer.part("prepare"):
            input_ids, positions, meta, logit_rows, lora = self.prepare(plan)
        self.prefault.run_ahead_of(int(meta.block_tables.max()))
        with timer.part("forward_rest"):
            hidden = self.model.forward(input_ids, positions, meta, self.kv_caches, lora)
        if len(logit_rows) == 0:
            return None
        seqs, outputs = plan.sampling_rows, plan.sampling_outputs
        with timer.part("sampling"):
            batch = SamplingBatch.build(
                [s.params for s in seqs], [s.prompt_token_ids for s in seqs], outputs,
                self.row_generators(seqs, outputs), self.model.config.vocab_size,
                eos_token_ids=self.eos_token_ids, grammar=grammar)
        return self.sample_tokens(hidden[logit_rows], batch, grammar)

    def sample_tokens(self, hidden: torch.Tensor, batch: SamplingBatch, grammar: GrammarMask | None) -> SamplerOutput:
        """The lm_head over the sampled rows, then a token per row; greedy picks from the top candidates alone."""
        greedy = batch.is_plain_greedy and self.model.ext is not None
        with self.timer.part("logits", opaque=True):  # the lm_head's matmul counts here
            logits = self.model.top_logits(hidden, grammar) if greedy else self.model.compute_logits(hidden)
        with self.timer.part("sampling"):
            if greedy:
                return sample_greedy_from_top(*logits, batch.banned)
            return sample(logits, batch, self.rng, self.model.ext)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: every (src, dst) block of the step in one batched gather/scatter per cache tensor."""
        if not copies:
            return
        src, dst = torch.tensor(copies, dtype=torch.int64).T
        for k_cache, v_cache in self.kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    @property
    def kv_block_shape(self) -> tuple[int, ...]:
        """One block's K and V in every layer, as the second tier stores it: [layers, 2, block_size, heads, row]."""
        return (len(self.kv_caches), 2, *self.kv_caches[0][0].shape[1:])

    def copy_blocks_out(self, block_ids: list[int]) -> torch.Tensor:
        """The K/V of these blocks copied out of the pool, [layers, 2, len(block_ids), block_size, heads, row]: one
        gather per cache tensor, so the pool may reuse the blocks at once."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        out = torch.empty((len(self.kv_caches), 2, len(block_ids), *self.kv_caches[0][0].shape[1:]),
                          dtype=self.kv_dtype)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            torch.index_select(k_cache, 0, index, out=out[layer, 0])
            torch.index_select(v_cache, 0, index, out=out[layer, 1])
        return out

    def copy_blocks_in(self, block_ids: list[int], blocks: torch.Tensor) -> None:
        """Write K/V into these pool blocks: `blocks` is [len(block_ids), *kv_block_shape], one block after another."""
        index = torch.tensor(block_ids, dtype=torch.int64)
        for layer, (k_cache, v_cache) in enumerate(self.kv_caches):
            k_cache.index_copy_(0, index, blocks[:, layer, 0])
            v_cache.index_copy_(0, index, blocks[:, layer, 1])

    def add_sequences(self, seqs: list[Sequence]) -> None:
        """Keep each seeded sequence's seed when its request arrives, `seed + index` for the index-th of n samples
        (so the n samples differ): a seed torch refuses is that request's error, never a step's."""
        for seq in seqs:
            if seq.params.seed is None:
                continue
            try:
                torch.Generator().manual_seed(seq.params.seed + seq.index)
            except (ValueError, RuntimeError, OverflowError) as e:
                for s in seqs:
                    self.release(s.seq_id)
                raise InvalidRequestError(f"seed {seq.params.seed} is out of range: {e}") from None
            self.seeds[seq.seq_id] = seq.params.seed + seq.index

    def row_generators(self, rows: list[Sequence], outputs: list[list[int]]) -> list[torch.Generator | None]:
        """Each seeded row's generator, seeded by its sequence's seed and the output position it samples (the number
        of outputs before it): a seeded token's draw depends on nothing else, so neither its batch-mates nor drafts
        nor preemption change a seeded request's tokens."""
        seeds = [self.seeds.get(seq.seq_id) for seq in rows]
        return [None if seed is None else torch.Generator().manual_seed(seed_at(seed, len(before)))
                for seed, before in zip(seeds, outputs, strict=True)]

    def release(self, seq_id: Hashable) -> None:
        self.seeds.pop(seq_id, None)

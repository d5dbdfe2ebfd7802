"""`pagedllm bench lora`: batched multi-LoRA throughput. Random adapters of rank r for the model are written in the
PEFT format to a temporary folder (nothing is downloaded), then one engine runs the same random workload three times:
on the base model alone, with requests spread over `--num-adapters` adapters by a Zipf law (a batch mixes them), and
over `--many-adapters` adapters with only `--max-loras` resident (the rest wait for a slot, evicted adapters are read
again)."""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time

from pagedllm.bench.results import write_json
from pagedllm.config import EngineConfig
from pagedllm.sampling_params import SamplingParams

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_random_adapter(path: str, model_config, rank: int, targets: tuple[str, ...], seed: int) -> str:
    """A PEFT folder of random A and B (B small, so outputs stay text-like) for every layer's targets."""
    import torch
    from safetensors.torch import save_file

    from pagedllm.model.loader.peft import projection_shape

    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(model_config.num_hidden_layers):
        for target in targets:
            projection = target.removesuffix("_proj")
            out_features, in_features = projection_shape(model_config, projection)
            module = f"base_model.model.model.layers.{layer}.{'self_attn' if projection in 'qkvo' else 'mlp'}.{target}"
            tensors[f"{module}.lora_A.weight"] = torch.randn(rank, in_features, generator=g) / in_features ** 0.5
            tensors[f"{module}.lora_B.weight"] = torch.randn(out_features, rank, generator=g) * 0.01
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(targets),
                   "bias": "none"}, f)
    return path


def zipf_picks(num_adapters: int, count: int, exponent: float, rng: random.Random) -> list[int]:
    """`count` adapter indices, index k drawn with probability proportional to 1 / (k + 1) ** exponent."""
    weights = [1 / (k + 1) ** exponent for k in range(num_adapters)]
    return rng.choices(range(num_adapters), weights, k=count)


def run(llm, prompts: list[list[int]], output_len: int, loras: list) -> dict:
    """Time one pass of the workload; the figures and how many requests failed (fewer tokens than asked)."""
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    failed = sum(len(o.outputs[0].token_ids) != output_len or o.outputs[0].finish_reason == "abort" for o in outs)
    return {"elapsed_s": round(elapsed, 2), "output_tokens": tokens, "output_tokens_per_s": round(tokens / elapsed, 1),
            "distinct_adapters": len({lora.lora_int_id for lora in loras if lora is not None}), "failed": failed}


def tokens_per_s(result: dict) -> float:
    return result["output_tokens_per_s"]


def save_adapters(args: argparse.Namespace) -> int:
    """`--save-adapters DIR`: the random adapters the mixed run would use, as DIR/lora0 ..., for another server (a
    side by side with vLLM's) to serve; nothing is run. Only the model's config is needed, read from its file."""
    from pagedllm.model.loader import load_config

    model_config = load_config(args.model)
    targets = tuple(args.targets.split(","))
    for i in range(args.num_adapters):
        print(write_random_adapter(os.path.join(args.save_adapters, f"lora{i}"), model_config, args.rank, targets,
                                   args.seed + i))
    return 0


def cmd_lora(args: argparse.Namespace) -> int:
    from pagedllm import LLM, LoRARequest
    from pagedllm.model.bf16_choice import torch_dtype_name

    if args.save_adapters:
        return save_adapters(args)
    config = EngineConfig.from_cli_args(args)
    config.enable_lora, config.max_lora_rank = True, max(config.max_lora_rank, args.rank)
    llm = LLM(**vars(config))
    llm.engine.wait_for_kv_cache()
    rng = random.Random(args.seed)
    vocab = llm.engine.model_config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(args.input_len)] for _ in range(args.num_prompts)]
    targets = tuple(args.targets.split(","))
    with tempfile.TemporaryDirectory(prefix="pagedllm-bench-lora-") as tmp:
        total = max(args.num_adapters, args.many_adapters)
        adapters = [LoRARequest(f"lora{i}", i + 1, write_random_adapter(
            os.path.join(tmp, f"lora{i}"), llm.engine.model_config, args.rank, targets, args.seed + i))
            for i in range(total)]
        t0 = time.perf_counter()
        for adapter in adapters:
            llm.engine.add_lora(adapter)
        register_s = time.perf_counter() - t0
        run(llm, prompts[:4], 4, [adapters[0], None, adapters[1], None])  # warm up both paths
        mix = [adapters[k] for k in zipf_picks(args.num_adapters, len(prompts), args.zipf, rng)]
        base, mixed = {"output_tokens_per_s": 0}, {"output_tokens_per_s": 0}
        for _ in range(args.repeats):  # interleaved, the best of each: a shared machine's load drifts
            base = max(base, run(llm, prompts, args.output_len, [None] * len(prompts)), key=tokens_per_s)
            mixed = max(mixed, run(llm, prompts, args.output_len, mix), key=tokens_per_s)
        loads_before = llm.engine.stats().lora_loads
        many = run(llm, prompts, args.output_len, [adapters[k] for k in zipf_picks(total, len(prompts), args.zipf,
                                                                                     rng)])
        many["adapter_loads"] = llm.engine.stats().lora_loads - loads_before
    result = {"model": llm.engine.model_name, "dtype": torch_dtype_name(config), "threads": config.num_threads,
              "max_cpu_loras": config.max_cpu_loras, "rank": args.rank, "targets": list(targets),
              "max_loras": config.max_loras,
              "num_prompts": args.num_prompts, "input_len": args.input_len, "output_len": args.output_len,
              "zipf": args.zipf, "register_s": round(register_s, 2), "base": base,
              f"mixed_{args.num_adapters}": mixed, f"many_{total}": many,
              "mixed_vs_base": round(mixed["output_tokens_per_s"] / base["output_tokens_per_s"], 3),
              "many_vs_base": round(many["output_tokens_per_s"] / base["output_tokens_per_s"], 3)}
    print(f"Base model: {base['output_tokens_per_s']} output tokens/s; {args.num_adapters} adapters (Zipf "
          f"{args.zipf}, {mixed['distinct_adapters']} used): {mixed['output_tokens_per_s']} "
          f"({result['mixed_vs_base']:.0%} of base); {total} adapters with {config.max_loras} resident: "
          f"{many['output_tokens_per_s']} "
          f"({result['many_vs_base']:.0%}), {many['adapter_loads']} loads, {many['failed']} failed requests")
    if args.output_json:
        write_json(args.output_json, result)
    return 0


def add_command(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lora", help="multi-LoRA throughput: base vs mixed adapters vs many adapters paged in")
    p.add_argument("--num-adapters", type=int, default=8, help="adapters of the mixed run")
    p.add_argument("--many-adapters", type=int, default=100,
                   help="adapters of the paged run (--max-loras resident, --max-cpu-loras kept in memory)")
    p.add_argument("--rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument("--targets", default=",".join(TARGETS), help="projections the adapters target, comma-separated")
    p.add_argument("--zipf", type=float, default=1.0, help="exponent of the adapters' popularity")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="base and mixed runs, interleaved; the best of each counts")
    p.add_argument("--output-json", default=None)
    p.add_argument("--save-adapters", metavar="DIR", default=None,
                   help="only write the --num-adapters random adapters (the mixed run's) to DIR/lora0 ... and exit")
    EngineConfig.add_cli_args(p)
    # the same prompts run again: no prefix cache, so that no run finds an earlier one's blocks
    p.set_defaults(func=cmd_lora, max_loras=8, max_cpu_loras=16, kv_cache_memory="1GiB", enable_prefix_caching=False)

"""The step's token budget (`--max-num-batched-tokens`) where the user set none, chosen where the engine runs.

A bigger step spreads each step's fixed costs over more tokens and fills wide matrix units, but every decode in it
waits for it. A budget in tokens is a different wait on every CPU (a 1,024-token step's matmuls: 0.14 s on an Intel
Xeon with AMX, 0.5-0.63 s on AMD EPYC Zen 4), so the cap is in time: the largest budget whose prompt step's matmuls,
from the measured kernel table, stay within STEP_MATMUL_S, and never below the first budget.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagedllm.config import FIRST_STEP_BUDGET
from pagedllm.model.dispatch import KernelTable

# 1,024: the budget before it was chosen, kept as the floor; 2,048 and 4,096: vLLM's CPU server's and offline LLM's.
# On the AMX Xeon 2,048 ran long prompts (32 x 1,900 tokens) 16% faster than 1,024 and 4,096 28%; on Zen 4, where a
# 1,024-token step's matmuls already take 0.5-0.63 s, neither paid (docs/performance.md, the AMX and Zen 4 sections).
BUDGETS = (FIRST_STEP_BUDGET, 2048, 4096)
# A prompt step's matmuls at most this long: the wait a step of the budget adds to the decodes sharing it. Kinds
# without matrix units spend 0.22-0.67 s at 1,024 tokens on the default model, and keep 1,024.
STEP_MATMUL_S = 0.3
LAYER_KINDS = ("qkv", "o", "gate_up", "down")  # a prompt step's matmuls; its lm_head runs on one row per sequence


@dataclass(frozen=True)
class StepBudget:
    """The budget chosen and, for the log, what it rests on."""

    tokens: int
    reason: str


def layer_seconds(table: KernelTable, rows: int) -> float | None:
    """One layer's matmuls at `rows`, each on its fastest timed path; None where a kind has no timing there."""
    total = 0.0
    for kind in LAYER_KINDS:
        if kind not in table.buckets or rows not in table.buckets[kind]:
            return None
        at = table.buckets[kind].index(rows)
        timed = [t[at] for t in table.times[kind].values() if t[at] is not None]
        if not timed:
            return None
        total += min(timed)
    return total


def choose(table: KernelTable | None, layers: int) -> StepBudget:
    """The largest of BUDGETS whose matmuls (the first budget's, timed, scaled by its tokens) fit STEP_MATMUL_S;
    the first where no table was measured (a forced kernel path) or it lacks the first budget's row count."""
    first = BUDGETS[0]
    per_layer = layer_seconds(table, first) if table is not None else None
    if per_layer is None:
        return StepBudget(first, "no kernel table timed a step of that many rows")
    seconds = per_layer * layers
    tokens = max((b for b in BUDGETS if seconds * b / first <= STEP_MATMUL_S), default=first)
    return StepBudget(tokens, f"a {first}-token prompt step's matmuls take {seconds * 1e3:.0f} ms by the kernel "
                              f"table; the largest budget within {STEP_MATMUL_S * 1e3:.0f} ms, at least {first}")

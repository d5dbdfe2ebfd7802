"""Failure isolation in a step: when the model step raises, find the requests whose presence makes it raise, by
re-running halves of the step's plan, so that only they fail and everyone else keeps their tokens. Validation at the
door should leave nothing for this to find; it is the second line of defence."""

from __future__ import annotations

import dataclasses

from pagedllm.core.plan import SchedulerOutput
from pagedllm.model.model_runner import ModelRunner


def without_requests(plan: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    """The plan minus every sequence of the given requests (copy-on-write copies kept: copying again is harmless)."""
    return dataclasses.replace(plan, scheduled=[s for s in plan.scheduled if s.seq.request_id not in request_ids])


def only_requests(plan: SchedulerOutput, request_ids: set[str]) -> SchedulerOutput:
    return dataclasses.replace(plan, scheduled=[s for s in plan.scheduled if s.seq.request_id in request_ids])


def failing_requests(runner: ModelRunner, plan: SchedulerOutput) -> list[str]:
    """The requests that make `runner.execute` raise on their own, found by halving: O(k log n) trial steps for k
    culprits among n requests. Trials write K/V the real step writes again, and the random generators are put back
    after them, so the survivors' outputs are those of a step that never failed."""
    state = runner.rng_state()
    culprits: list[str] = []
    pending = [list(dict.fromkeys(s.seq.request_id for s in plan.scheduled))]
    try:
        while pending:
            part = pending.pop()
            if not _fails(runner, only_requests(plan, set(part))):
                continue
            if len(part) == 1:
                culprits.append(part[0])
            else:
                pending += [part[len(part) // 2:], part[:len(part) // 2]]
    finally:
        runner.set_rng_state(state)
    return culprits


def _fails(runner: ModelRunner, plan: SchedulerOutput) -> bool:
    try:
        runner.execute(plan)
    except Exception:
        return True
    return False

"""A failed step's requests rerun in parts until the one at fault is found: it fails alone, the others keep their
tokens and blocks. Nothing was committed when the model raised, so a part recomputes its chunk exactly."""

from __future__ import annotations

import logging
from collections.abc import Callable

from pagedllm.core.plan import SchedulerOutput
from pagedllm.core.sequence import SequenceGroup
from pagedllm.outputs import RequestOutput

logger = logging.getLogger("pagedllm")
MAX_FAILED_STEPS_IN_A_ROW = 8  # steps in which nothing ran: the model fails whatever it runs


class EngineBrokenError(RuntimeError):
    """The engine cannot go on (its state is inconsistent, or the model fails on every request): replace it."""


class StepIsolation:
    """Runs a failed step's parts through the engine's `run` (model, commit, outputs) and fails a request the model
    fails on even alone through `fail` (which returns its final output); `check` verifies the block pool after."""

    def __init__(self, run: Callable[[SchedulerOutput], list[RequestOutput]],
                 fail: Callable[[SequenceGroup, BaseException], RequestOutput], check: Callable[[], None]) -> None:
        self.run, self.fail, self.check = run, fail, check
        self.failed_steps_in_a_row = 0

    def rerun(self, plan: SchedulerOutput, groups: list[SequenceGroup], error: Exception) -> list[RequestOutput]:
        """The step's outputs, its requests rerun in parts (those already decoding apart from those still in their
        prompt, then halves) until each part runs or is one request. Raises EngineBrokenError when nothing ran."""
        logger.warning("a step of %d requests failed (%r); rerunning it in parts to find the request at fault",
                       len(groups), error)
        outputs: list[RequestOutput] = []
        failed: list[RequestOutput] = []
        decoding = [g for g in groups if g.is_decoding]
        prompts = [g for g in groups if not g.is_decoding]  # the newest admissions are here
        parts = [decoding, prompts] if decoding and prompts else halves(groups)
        for part in parts if len(groups) > 1 else []:
            self.run_part(plan, part, outputs, failed)
        if len(groups) == 1:
            failed.append(self.fail(groups[0], error))
        self.check()  # a failure must leave the pool consistent, or the engine is replaced
        self.count(len(failed) == len(groups), len(groups), error)
        return outputs + failed

    def run_part(self, plan: SchedulerOutput, part: list[SequenceGroup], outputs: list[RequestOutput],
                 failed: list[RequestOutput]) -> None:
        try:
            outputs += self.run(subplan(plan, part))
        except Exception as error:
            if len(part) > 1:
                for half in halves(part):
                    self.run_part(plan, half, outputs, failed)
                return
            logger.error("request %s failed its step alone; failing it: %r", part[0].request_id, error)
            failed.append(self.fail(part[0], error))

    def count(self, all_failed: bool, num_groups: int, error: Exception) -> None:
        """The model fails whatever it runs when every request of a step failed alone: several at once, or one
        request's steps MAX_FAILED_STEPS_IN_A_ROW times in a row."""
        if not all_failed:
            self.failed_steps_in_a_row = 0
            return
        self.failed_steps_in_a_row += 1
        if num_groups > 1 or self.failed_steps_in_a_row >= MAX_FAILED_STEPS_IN_A_ROW:
            raise EngineBrokenError(f"the model failed on every request of {self.failed_steps_in_a_row} "
                                    f"step(s) in a row, even alone: {error!r}") from error


def halves(groups: list[SequenceGroup]) -> list[list[SequenceGroup]]:
    return [groups[:len(groups) // 2], groups[len(groups) // 2:]]


def subplan(plan: SchedulerOutput, part: list[SequenceGroup]) -> SchedulerOutput:
    """The plan's share of `part`, with the copy-on-write copies into its own blocks (copying again is harmless:
    the source blocks' shared prefix has not changed)."""
    seqs = {id(seq) for g in part for seq in g.seqs}
    scheduled = [s for s in plan.scheduled if id(s.seq) in seqs]
    own = {b for s in scheduled for b in s.block_table}
    return SchedulerOutput(budget=0, scheduled=scheduled, copies=[c for c in plan.copies if c[1] in own],
                           lora_loads=plan.lora_loads)  # loading an adapter twice is harmless

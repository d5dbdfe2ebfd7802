"""Fault injection for tests: a step that fails for one chosen request, or an engine that breaks for good.

Never on in production: only an explicit `LLMEngine(config, faults=FaultInjector(...))` or the environment variable
PAGEDLLM_TEST_FAULTS (e.g. `fail_seed=4242,fatal_seed=4343`, for a server a test starts) turns it on; no CLI flag
does. Requests are chosen by their seed, which any endpoint and `SamplingParams` carry.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, fields

from pagedllm.core.plan import SchedulerOutput

ENV_VAR = "PAGEDLLM_TEST_FAULTS"
logger = logging.getLogger("pagedllm")


class InjectedFault(RuntimeError):
    """The failure a FaultInjector raises (a stand-in for a kernel or sampler bug)."""


@dataclass
class FaultInjector:
    fail_seed: int | None = None  # a model step that runs a request with this seed raises (isolation finds it)
    fatal_seed: int | None = None  # a step that schedules a request with this seed breaks the engine (a restart)

    @classmethod
    def from_env(cls) -> FaultInjector | None:
        """The injector PAGEDLLM_TEST_FAULTS describes, or None when it is unset (always, outside tests)."""
        spec = os.environ.get(ENV_VAR, "").strip()
        if not spec:
            return None
        names = {f.name for f in fields(cls)}
        values = dict(item.split("=", 1) for item in spec.split(","))
        if not set(values) <= names:
            raise ValueError(f"{ENV_VAR}: unknown faults {sorted(set(values) - names)}; known: {sorted(names)}")
        logger.warning("%s is set: test faults are injected (%s)", ENV_VAR, spec)
        return cls(**{k: int(v) for k, v in values.items()})

    def check_model_step(self, plan: SchedulerOutput) -> None:
        """Raise if the step would run a request chosen to fail (as a bad kernel input would)."""
        if self.fail_seed is not None and any(s.seq.params.seed == self.fail_seed for s in plan.scheduled):
            raise InjectedFault(f"injected step failure (a request with seed {self.fail_seed})")

    def check_engine(self, plan: SchedulerOutput) -> None:
        """Raise outside what the step can isolate, as a corrupted engine would."""
        if self.fatal_seed is not None and any(s.seq.params.seed == self.fatal_seed for s in plan.scheduled):
            raise InjectedFault(f"injected engine failure (a request with seed {self.fatal_seed})")

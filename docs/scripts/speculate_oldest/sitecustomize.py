"""An experiment, not part of the engine: past `--speculative-disable-by-batch-size`, the K running decodes with the
most output tokens still speculate (a workload's longest requests set its end; at a big batch K of them cost a few
rows). Loaded by Python at start-up when this folder is first on PYTHONPATH, e.g. against the plain engine:
    SPECULATE_OLDEST=4 docs/scripts/serve_ab.sh W 2 64 /work/main /work/main/docs/scripts/speculate_oldest:/work/main
(serve_ab.sh passes the environment on; SPECULATE_OLDEST defaults to 4). Measured and dropped: docs/performance-log.md.
"""

import os

from pagedllm.core.scheduler import Scheduler

OLDEST = int(os.environ.get("SPECULATE_OLDEST", "4"))
_may_speculate, _plan_writes = Scheduler._may_speculate, Scheduler._plan_writes


def may_speculate(self: Scheduler) -> bool:
    self._oldest = None
    if not self.num_speculative_tokens or _may_speculate(self):
        return bool(self.num_speculative_tokens)
    decodes = [s for g in self.running if g.is_decoding for s in g.live_seqs]
    self._oldest = {s.seq_id for s in sorted(decodes, key=lambda s: -s.num_output_tokens)[:OLDEST]}
    return bool(self._oldest)


def plan_writes(self: Scheduler, group, budget: int, speculate: bool = False):
    if speculate and getattr(self, "_oldest", None) is not None:
        speculate = any(s.seq_id in self._oldest for s in group.live_seqs)
    return _plan_writes(self, group, budget, speculate)


Scheduler._may_speculate, Scheduler._plan_writes = may_speculate, plan_writes

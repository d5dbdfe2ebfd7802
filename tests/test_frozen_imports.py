"""`from pagedllm import LLM` (and the CLI's command modules) are imported with the cyclic collector held off and
their objects frozen after (pagedllm/frozen_imports.py): no collection walks torch's and the engine's import-time
objects, and the collector is left as the caller had it. Each case in a fresh interpreter: an import happens once."""

from __future__ import annotations

import json
import subprocess
import sys

PROBE = """
import gc, json
import pagedllm  # the package alone: no torch yet
counts = []
gc.callbacks.append(lambda phase, info: counts.append(info["generation"]) if phase == "stop" else None)
{before}
from pagedllm import LLM, SamplingParams
print(json.dumps({{"collections": len(counts), "frozen": gc.get_freeze_count(), "enabled": gc.isenabled()}}))
"""


def probe(before: str = "") -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE.format(before=before)], capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_engine_is_imported_without_a_collection_and_frozen_after():
    seen = probe()
    # torch's and the engine's objects (~180k) out of the collector's way; with it running, some 380 passes were made
    assert seen["collections"] == 0 and seen["frozen"] > 50_000 and seen["enabled"]


def test_a_collector_the_caller_turned_off_stays_off():
    assert probe("gc.disable()")["enabled"] is False

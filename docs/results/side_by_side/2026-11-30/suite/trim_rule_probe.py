"""The heap trim rule in one process: the default model built twice; RSS after each build and whether it trimmed.

PYTHONSAFEPATH=1 PYTHONPATH=REPO python trim_rule_probe.py
"""
from pathlib import Path

from pagedllm import LLM
from pagedllm.model import heap


def rss_mb() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * 4096 >> 20


calls = []
trim = heap.trim
heap.trim = lambda: calls.append(1) or trim()
for build in (1, 2):
    llm = LLM()
    print(f"build {build}: checkpoint {heap._largest_build} bytes, RSS {rss_mb()} MB, trims so far {len(calls)}")
    del llm

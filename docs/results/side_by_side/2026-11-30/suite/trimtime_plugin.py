"""pytest plugin: time spent inside the engine's heap trim, and the calls (a probe)."""
import atexit
import os
import time

from pagedllm.model import heap

_orig = heap.trim
_stats = {"calls": 0, "seconds": 0.0, "max": 0.0}


def _timed() -> bool:
    start = time.perf_counter()
    try:
        return _orig()
    finally:
        took = time.perf_counter() - start
        _stats["calls"] += 1
        _stats["seconds"] += took
        _stats["max"] = max(_stats["max"], took)


heap.trim = _timed
atexit.register(lambda: open(os.environ.get("TRIM_LOG", "/tmp/trim_time.txt"), "a").write(f"{_stats}\n"))

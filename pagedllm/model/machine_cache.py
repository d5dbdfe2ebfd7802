"""What machine this is, and the measurements kept for it: the kernel table (model/dispatch.py) and the machine-limit
speeds (bench/roofline.py) hold for one CPU model, ISA, thread count and torch, and are worth keeping only when
nothing else ran beside them. Cached as JSON in the user's cache directory, each file written whole."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path
from typing import TypeVar

import torch

from pagedllm.model.threads import TAKEN_CORE, CpuSample, affinity, others_cpu, read_cpu_sample

logger = logging.getLogger("pagedllm")
CACHE_ENV = "PAGEDLLM_CACHE_DIR"


def cpu_identity() -> tuple[str, str]:
    """The CPU's model name and its ISA flags (from /proc/cpuinfo)."""
    name, flags = platform.processor(), ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and name == platform.processor():
                    name = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = " ".join(sorted(line.split(":", 1)[1].split()))
                    break
    except OSError:
        pass
    return name, flags


def l3_bytes() -> int | None:
    """The last-level cache's size as sysfs gives it (e.g. "32768K"), or None."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
        return int(text[:-1]) << {"K": 10, "M": 20}[text[-1]] if text[-1] in "KM" else int(text)
    except (OSError, ValueError, IndexError):
        return None


def machine_key() -> dict[str, str]:
    """What any measurement here holds for: CPU model, ISA flags, threads and torch (bench/roofline.py keys its peak
    matmul rate by it too)."""
    cpu, flags = cpu_identity()
    return {"cpu": cpu, "isa": hashlib.sha256(flags.encode()).hexdigest()[:16], "threads": str(torch.get_num_threads()),
            "torch": torch.__version__}


def prebuild_part(key: dict[str, str]) -> dict[str, str]:
    """A kernel table's key without the layer shapes, which are known only once the model is built."""
    return {k: v for k, v in key.items() if k != "shapes"}


def cache_file(key: dict[str, str], prefix: str = "kernels") -> Path:
    """Named by the key's part known before the build, so the engine finds the bounded-shapes decision in time to
    size oneDNN's cache (dispatch.primitive_cache_capacity)."""
    root = os.environ.get(CACHE_ENV) or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pagedllm"
    digest = hashlib.sha256(json.dumps(prebuild_part(key), sort_keys=True).encode()).hexdigest()[:16]
    return Path(root) / f"{prefix}-{digest}.json"


def machine_load() -> float:
    """Other processes on the cores make every timing a time slice's, not the kernel's: such a table is not kept."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return 0.0


def cpu_sample() -> CpuSample | None:
    return read_cpu_sample(affinity())


def others_since(start: CpuSample | None) -> float:
    """The CPUs' worth of time other processes used on ours since `start` (the thread governor's count): the load
    average lags a neighbour that just started by up to a minute, and a table measured beside one holds its timing,
    not the kernels'."""
    end = cpu_sample()
    return 0.0 if start is None or end is None or end.wall <= start.wall else others_cpu(start, end)


def quiet(load: float, others: float) -> bool:
    """Measured with no other process holding TAKEN_CORE of a core (the governor's threshold) or more."""
    return load <= (os.cpu_count() or 1) and others < TAKEN_CORE


def load_json(path: Path, key: dict[str, str], ignore: tuple[str, ...] = ()) -> dict | None:
    """A cached measurement, if its file is there, readable and measured for `key` (its "key" field, but for the
    fields in `ignore`)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("key"), dict):
        return None
    return data if {k: v for k, v in data["key"].items() if k not in ignore} == key else None


def save_json(path: Path, data: dict) -> None:
    """Written whole or not at all (another process may be reading or writing it too)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError as e:
        logger.warning("could not cache a measurement at %s: %s", path, e)


# Tables measured while other processes held the cores: not cached on disk (the next start measures again), but this
# process's later builds of the same key reuse them rather than time the same busy machine again.
_unsaved: dict[str, object] = {}
T = TypeVar("T")


def unsaved(key: dict[str, str], kind: type[T]) -> T | None:
    """A `kind` table this process measured for `key` while others held the cores, if any."""
    table = _unsaved.get(json.dumps(key, sort_keys=True))
    return table if isinstance(table, kind) else None


def keep_unsaved(key: dict[str, str], table: object) -> None:
    _unsaved[json.dumps(key, sort_keys=True)] = table

"""A benchmark's result written as JSON: here, not in client.py, so offline benchmarks need not import the HTTP
client to write theirs."""

from __future__ import annotations

import json
from typing import Any


def write_json(path: str, result: dict[str, Any]) -> None:
    """`result` as indented JSON; a NaN or infinity is an error (JSON has neither)."""
    with open(path, "w") as f:
        json.dump(result, f, indent=2, allow_nan=False)

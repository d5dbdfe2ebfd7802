"""Figures of serving runs: KV cache usage and running requests over time, and Figure 12's normalized latency
against request rate. matplotlib is imported only when a plot is asked for (`pyplot`, which other benchmarks use too).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any


def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(panels: Sequence[tuple[str, dict[str, list[dict]]]], path: str) -> None:
    """KV cache usage (top) and running requests (bottom) over time: one column per (title, {label: timeline})."""
    plt = pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(4.5 * len(panels), 6), sharex="col", squeeze=False)
    for col, (title, timelines) in enumerate(panels):
        for label, timeline in timelines.items():
            t = [s["t_s"] for s in timeline]
            axes[0][col].plot(t, [100 * (s["kv_cache_usage"] or 0) for s in timeline], label=label or None)
            axes[1][col].plot(t, [s["num_running"] or 0 for s in timeline], label=label or None)
        axes[0][col].set_title(title)
        axes[1][col].set_xlabel("time (s)")
    axes[0][0].set_ylabel("KV cache usage (%)")
    axes[1][0].set_ylabel("running requests")
    if any(label for _, timelines in panels for label in timelines):
        axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_sweep(result: dict[str, Any], path: str) -> None:
    """Figure 12's shape: normalized latency against request rate, one line per memory policy."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 4))
    for policy in result["policies"]:
        points = [p for p in result["points"] if p["kv_policy"] == policy and p["normalized_latency_s_per_token"]
                  and math.isfinite(float(p["request_rate"]))]  # an all-at-once run has no place on a rate axis
        ax.plot([float(p["request_rate"]) for p in points], [p["normalized_latency_s_per_token"] for p in points],
                marker="o", label=policy)
    if result.get("latency_threshold_s_per_token"):
        ax.axhline(result["latency_threshold_s_per_token"], color="grey", linestyle="--", linewidth=1,
                   label="threshold")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(f"{os.path.basename(os.path.normpath(result.get('model') or 'default model'))}, "
                 f"{result.get('dataset')}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def timeline_path(path: str) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}-timeline{ext or '.png'}"

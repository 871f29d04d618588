"""Writing results: summary JSON and time-series plots (matplotlib, Agg). Explicit calls only —
``Simulator.run()`` never writes a file."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from sim.simulator import SimResult


def _clean(x: Any) -> Any:
    """JSON-safe: NaN/inf → None, numpy scalars → Python."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def result_json(result: SimResult, include_timeseries: bool = True) -> dict[str, Any]:
    out: dict[str, Any] = {"summary": result.summary, "meta": result.meta}
    if include_timeseries:
        out["timeseries"] = result.timeseries
    return _clean(out)


def write_json(result: SimResult, path: str | Path, include_timeseries: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_json(result, include_timeseries), indent=2) + "\n")


def write_records(result: SimResult, path: str | Path) -> None:
    """Per-request columns as a compressed .npz (one array per column)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **result.records)


def plot(result: SimResult, path: str | Path, title: str | None = None) -> None:
    """Five stacked panels over time: load, queue/in-flight, T per tier, latency percentiles,
    SLO attainment (per control window)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = {k: np.asarray(v, dtype=float) for k, v in result.timeseries.items()}
    if "time_s" not in ts:
        raise ValueError("result has no time series (no control tick ran)")
    t = ts["time_s"]
    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    ax = axes[0]
    ax.plot(t, ts["arrival_rate"], label="arrivals/s", lw=0.8)
    ax.set_ylabel("load (req/s)")
    ax2 = ax.twinx()
    ax2.plot(t, ts["replicas"], color="tab:gray", lw=0.8, label="replicas")
    ax2.set_ylabel("replicas")
    ax = axes[1]
    ax.plot(t, ts["queue_depth"], label="queued", lw=0.8)
    ax.plot(t, ts["in_flight"], label="in flight", lw=0.8)
    ax.set_ylabel("requests")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    for key in sorted(k for k in ts if k.startswith("T_")):
        ax.plot(t, ts[key], label=key[2:], lw=0.9)
    ax.set_ylabel("threshold T")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[3]
    for key, label in (("tpot_p50_ms", "TPOT p50"), ("tpot_p95_ms", "TPOT p95"), ("tpot_p99_ms", "TPOT p99")):
        ax.plot(t, ts[key], label=label, lw=0.8)
    ax.set_ylabel("ms (window)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[4]
    ax.plot(t, ts["attainment"], lw=0.8)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("SLO attainment")
    ax.set_xlabel("simulated time (s)")
    s = result.summary
    head = title or f"{result.meta.get('workload', '')} — {result.meta.get('policy', '')}"
    sub = (f"attainment {s['slo_attainment']:.3f}, distortion {s['mean_distortion']:.3f}, "
           f"{s['replica_seconds']:.0f} replica-s")
    attribution = result.meta.get("attribution")
    fig.suptitle(head + "\n" + sub + (f"\n{attribution}" if attribution else ""), fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def plot_compare(rows: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Attainment vs mean distortion, one point per policy (up-left is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 5))
    for r in rows:
        ax.scatter(r["mean_distortion"], r["slo_attainment"], s=30)
        ax.annotate(r["policy"], (r["mean_distortion"], r["slo_attainment"]), fontsize=8,
                    xytext=(4, 2), textcoords="offset points")
    ax.set_xlabel("mean distortion per token (TV)")
    ax.set_ylabel("SLO attainment")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)

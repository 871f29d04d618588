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
    cleaned: dict[str, Any] = _clean(out)
    return cleaned


def write_json(result: SimResult, path: str | Path, include_timeseries: bool = True) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result_json(result, include_timeseries), indent=2) + "\n")


def write_records(result: SimResult, path: str | Path) -> None:
    """Per-request columns as a compressed .npz (one array per column)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path, **result.records)  # type: ignore[arg-type]


def _binned(t: np.ndarray, v: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Mean of ``v`` per bin of ``t`` (NaN for empty bins)."""
    idx = np.digitize(t, edges) - 1
    out = np.full(edges.size - 1, np.nan)
    ok = (idx >= 0) & (idx < out.size) & np.isfinite(v)
    sums = np.bincount(idx[ok], weights=v[ok], minlength=out.size)
    counts = np.bincount(idx[ok], minlength=out.size)
    np.divide(sums, counts, out=out, where=counts > 0)
    return out


def plot(result: SimResult, path: str | Path, title: str | None = None, bins: int = 150) -> None:
    """Five stacked panels over time: load, queue/in-flight, T per tier, TPOT percentiles and SLO
    attainment. Latency and attainment come from the per-request records, binned by completion
    time into ``bins`` intervals (a 1 s control window holds too few completions to read)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ts = {k: np.asarray(v, dtype=float) for k, v in result.timeseries.items()}
    if "time_s" not in ts:
        raise ValueError("result has no time series (no control tick ran)")
    t = ts["time_s"]
    rec = result.records
    horizon = float(t[-1])
    edges = np.linspace(0.0, horizon, max(2, bins) + 1)
    mid = (edges[:-1] + edges[1:]) / 2
    width = edges[1] - edges[0]

    fig, axes = plt.subplots(5, 1, figsize=(10, 12), sharex=True)
    ax = axes[0]
    arrivals = np.histogram(rec["arrival_s"], bins=edges)[0] / width
    ax.plot(mid, arrivals, lw=0.9, label="arrivals/s")
    ax.set_ylabel(f"load (req/s, {width:.0f} s bins)")
    ax2 = ax.twinx()
    ax2.step(t, ts["replicas"], where="post", color="tab:gray", lw=0.8)
    ax2.set_ylabel("replicas", color="tab:gray")
    ax = axes[1]
    ax.plot(mid, _binned(t, ts["queue_depth"], edges), label="queued", lw=0.9)
    ax.plot(mid, _binned(t, ts["in_flight"], edges), label="in flight", lw=0.9)
    ax.set_ylabel("requests (bin mean)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[2]
    for key in sorted(k for k in ts if k.startswith("T_")):
        ax.step(t, ts[key], where="post", label=key[2:], lw=0.9)
    ax.set_ylabel("threshold T")
    ax.legend(loc="upper right", fontsize=8)

    done = ~np.isnan(rec["completion_s"])
    c = rec["completion_s"][done]
    n = rec["output_tokens"][done]
    f = rec["first_token_s"][done]
    with np.errstate(invalid="ignore", divide="ignore"):
        tpot = np.where(n > 1, (c - f) * 1000.0 / np.maximum(n - 1, 1), np.nan)
    idx = np.digitize(c, edges) - 1
    ax = axes[3]
    for q, style in ((50, ":"), (95, "-"), (99, "--")):
        vals = np.full(mid.size, np.nan)
        for b in range(mid.size):
            sel = tpot[(idx == b) & np.isfinite(tpot)]
            if sel.size:
                vals[b] = np.percentile(sel, q)
        ax.plot(mid, vals, style, lw=0.9, label=f"TPOT p{q}")
    ax.set_ylabel("TPOT ms (by completion)")
    ax.legend(loc="upper right", fontsize=8)
    ax = axes[4]
    met = rec["slo_met"]
    finish_t = np.where(done, rec["completion_s"], rec["arrival_s"])  # rejections count at arrival
    counted = done | rec["rejected"]
    att = _binned(finish_t[counted], met[counted].astype(float), edges)
    ax.plot(mid, att, lw=0.9)
    ax.set_ylim(-0.02, 1.02)
    ax.set_ylabel("SLO attainment (by completion)")
    ax.set_xlabel("simulated time (s)")
    s = result.summary
    head = title or f"{result.meta.get('workload', '')} — {result.meta.get('policy_name', '')}"
    sub = (f"attainment {s['slo_attainment']:.3f}, mean distortion {s['mean_distortion']:.4f}, "
           f"{s['replica_seconds']:.0f} replica-s, seed {result.meta.get('seed')}")
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

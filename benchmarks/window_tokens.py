"""Tokens per sequence-iteration a live service measured, by operating point and batch, from recorded control windows.

Reads ``benchmarks/load.py --ticks`` files (or saved ``/v1/fsd/status`` answers) and keeps a tier's windows that
ran one (T, k) throughout: the window before it reported the same point (a step started before a change ends after
it) and, with ``--speculative-only`` (default), the window ran no plain step. Per (T, k) and batch bin (the
window's mean batch size) it sums the tier's output tokens, sequence-iterations and distortion, and prints JSON
(and writes ``--out``): windows, tokens per sequence-iteration, distortion per token.

What it is for: telling a difference in acceptance from a difference in conditions. The windows of different points
come from different moments (an adaptive policy drafts at its high T in a burst, after switching from plain
decoding), and a window's tokens per sequence-iteration also counts the clipped last iteration of each request that
ends in it; comparing points in one batch bin removes one confound, not all. The engine's own measure of acceptance
by T is ``fsd calibrate --divs kl --thresholds kl=... --prompts 16`` (docs/figures.md, session 35)::

    .venv/bin/python benchmarks/window_tokens.py docs/img/load_economy_s4*_ticks.json.gz --tier economy
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.report import emit  # noqa: E402
from sim.decision_replay import load_histories  # noqa: E402


def _batch_bin(batch: float, edges: Sequence[float]) -> str:
    """The label of the bin holding ``batch``: "<=e0", "e0-e1", ..., ">eN"."""
    lo: float | None = None
    for edge in edges:
        if batch <= edge:
            return f"<={edge:g}" if lo is None else f"{lo:g}-{edge:g}"
        lo = edge
    return f">{edges[-1]:g}"


def window_tokens(histories: Mapping[str, Sequence[Mapping[str, Any]]], tier: str, edges: Sequence[float],
                  speculative_only: bool = True) -> dict[str, dict[str, dict[str, float]]]:
    """Per "T=…,k=…" and batch bin (plus "all"): the steady windows' sums and ratios (see the module doc)."""
    sums: dict[tuple[float, int], dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0, 0]))
    for history in histories.values():
        prev: tuple[float, int] | None = None
        for entry in history:
            telemetry = entry.get("telemetry")
            window = (telemetry.get("tiers") or {}).get(tier) if telemetry else None
            if telemetry is None or window is None or window.get("draft_length") is None:
                prev = None
                continue
            point = (float(window["threshold"]), int(window["draft_length"]))
            plain = (telemetry.get("plain_steps") or {}).get("steps", 0)
            batch = telemetry.get("mean_batch_size")
            if (prev == point and window["sequence_iterations"] > 0 and batch is not None
                    and not (speculative_only and point[1] > 0 and plain)):
                for label in (_batch_bin(float(batch), edges), "all"):
                    s = sums[point][label]
                    s[0] += window["output_tokens"]
                    s[1] += window["sequence_iterations"]
                    s[2] += window["mean_distortion"] * window["output_tokens"]
                    s[3] += 1
            prev = point
    out: dict[str, dict[str, dict[str, float]]] = {}
    for (t, k), by_bin in sorted(sums.items()):
        out[f"T={t:g},k={k}"] = {
            label: {"windows": int(n), "output_tokens": int(tokens), "sequence_iterations": int(iters),
                    "tokens_per_sequence_iteration": round(tokens / iters, 4),
                    "distortion_per_token": round(dist / tokens, 5) if tokens else 0.0}
            for label, (tokens, iters, dist, n) in sorted(by_bin.items())
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("ticks", nargs="+", help="benchmarks/load.py --ticks files (or saved /v1/fsd/status answers)")
    ap.add_argument("--tier", default="economy")
    ap.add_argument("--batch-edges", default="2.5,5.5", help="upper edges of the batch bins (mean batch size)")
    ap.add_argument("--all-windows", action="store_true", help="keep drafting windows that also ran plain steps")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    try:
        edges = [float(e) for e in args.batch_edges.split(",") if e.strip()]
        if not edges or edges != sorted(edges):
            raise ValueError(f"--batch-edges {args.batch_edges!r}: give ascending numbers")
        histories: dict[str, Sequence[Mapping[str, Any]]] = {}
        for path in args.ticks:
            for label, history in load_histories(path).items():
                histories[f"{path}:{label}"] = history
    except ValueError as exc:
        raise SystemExit(f"window_tokens: {exc}") from None
    emit({"benchmark": "window_tokens", "files": args.ticks, "tier": args.tier, "batch_edges": edges,
          "speculative_only": not args.all_windows,
          "points": window_tokens(histories, args.tier, edges, not args.all_windows)}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

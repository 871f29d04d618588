"""Comparing policies on one workload: one summary row per run and a markdown table of them.

Used by ``fsd sim compare`` and ``benchmarks/policy_compare.py``.
"""

from __future__ import annotations

from typing import Any

#: The columns of a comparison row, in table order.
COLUMNS = ("policy", "slo_attainment", "goodput_rps", "tpot_p95_ms", "ttft_p95_ms", "mean_distortion",
           "replica_seconds", "cost_per_1k_tokens_rs", "completed", "rejected")


def summary_row(name: str, s: dict[str, Any]) -> dict[str, Any]:
    """The comparison row of one run, from its ``SimResult.summary``."""
    return {
        "policy": name,
        "slo_attainment": s["slo_attainment"],
        "goodput_rps": s["goodput_rps"],
        "tpot_p95_ms": s["tpot_ms"]["p95"],
        "ttft_p95_ms": s["ttft_ms"]["p95"],
        "mean_distortion": s["mean_distortion"],
        "replica_seconds": s["replica_seconds"],
        "cost_per_1k_tokens_rs": s["cost_per_1k_tokens"]["replica_seconds"],
        "completed": s["completed"],
        "rejected": s["rejected"],
    }


def markdown_table(rows: list[dict[str, Any]]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return "-" if v is None else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def tier_table(rows: list[dict[str, Any]]) -> str:
    """Per policy and tier: attainment vs the tier's percentile, distortion vs its budget."""
    lines = ["| policy | tier | arrivals | slo_attainment | target | mean_distortion | budget | meets_slo |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        for tier, v in r["tiers"].items():
            budget = "-" if v["distortion_budget"] is None else f"{v['distortion_budget']:.4g}"
            lines.append(f"| {r['policy']} | {tier} | {v['arrivals']} | {v['slo_attainment']:.4g} | "
                         f"{v['attainment_target']:.4g} | {v['mean_distortion']:.4g} | {budget} | "
                         f"{'yes' if v['meets_slo'] else 'no'} |")
    return "\n".join(lines)

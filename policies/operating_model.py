"""The operating model: what the model-predictive policy knows of a draft/target pair before it measures.

Plain data: operating points over (T, k) (tokens per step and distortion, k = 0 included) and the step's cost
in the simulator's terms (sim/profile.py). ``sim.profile.Profile.to_operating_model`` builds it from a
calibrated profile; the live controller loads the shipped default pair's (:data:`DEFAULT_MODEL_PATH`) or the
one its config names. It crosses the policy / simulator / controller boundary, so it lives apart from the
policy that reads it (:mod:`policies.mpc`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from policies.telemetry import StepTotals

MODELS_DIR = Path(__file__).parent / "models"
#: The operating model of the default pair (SmolLM2-135M → int8 copy), converted from the calibrated
#: profile sim/profiles/smollm2-135m.json; what a live controller without a profile of its own uses.
DEFAULT_MODEL_PATH = MODELS_DIR / "smollm2-135m.json"


@dataclass(frozen=True, slots=True)
class OperatingPoint:
    """At (T, k): mean tokens emitted per sequence per step (1 + accepted drafts) and mean distortion."""

    threshold: float
    k: int
    tokens_per_step: float
    mean_distortion: float
    #: Tokens per step at an engine batch of 1, 2, … rows (``()``: the same at every batch; beyond the
    #: last entry, the last). ``tokens_per_step`` is the batch the acceptance was measured at.
    tokens_per_step_by_batch: tuple[float, ...] = ()
    #: Tokens per step of the request at each of the model's :attr:`OperatingModel.request_quantiles` of
    #: per-request acceptance (hardest first; ``()``: no per-request spread modelled). A request's TPOT is its own
    #: mean over its life: a tier's attainment is decided by its hard requests, not by the mean one.
    tokens_per_step_by_quantile: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not (math.isfinite(self.threshold) and self.threshold >= 0):
            raise ValueError(f"threshold must be finite and >= 0, got {self.threshold}")
        if self.k < 0:
            raise ValueError(f"k must be >= 0, got {self.k}")
        for tokens in (self.tokens_per_step, *self.tokens_per_step_by_batch):
            if not (math.isfinite(tokens) and 1.0 <= tokens <= self.k + 1 + 1e-9):
                raise ValueError(f"tokens_per_step must be in [1, k + 1], got {tokens} at k={self.k}")
        if not (math.isfinite(self.mean_distortion) and self.mean_distortion >= 0):
            raise ValueError(f"mean_distortion must be finite and >= 0, got {self.mean_distortion}")
        q = self.tokens_per_step_by_quantile
        if any(not (math.isfinite(t) and 1.0 <= t <= self.k + 1 + 1e-9) for t in q):
            raise ValueError(f"tokens_per_step_by_quantile must be in [1, k + 1], got {list(q)} at k={self.k}")
        if any(b < a - 1e-9 for a, b in zip(q, q[1:], strict=False)):
            raise ValueError(f"tokens_per_step_by_quantile must not fall from hard to easy requests, got {list(q)}")


@dataclass(frozen=True, slots=True)
class StepCost:
    """Step time in ms over B rows (the simulator's model; see sim/profile.py):

    * all rows at k = 0: ``plain_fixed_ms + plain_per_seq_ms · B``;
    * otherwise ``k_max · (draft_fixed_ms) + verify_fixed_ms + Σ_rows (verify_per_seq_ms +
      verify_per_token_ms · k_r + [k_r > 0] · k_max · draft_per_seq_ms)``.
    """

    draft_fixed_ms: float
    draft_per_seq_ms: float
    verify_fixed_ms: float
    verify_per_seq_ms: float
    verify_per_token_ms: float
    plain_fixed_ms: float
    plain_per_seq_ms: float
    prefill_fixed_ms: float = 0.0
    prefill_ms_per_token: float = 0.0
    #: The draft's forward over tokens it has not seen: a row that ran at k = 0 (the draft skipped its
    #: prompt and output) catches up when it drafts, one padded forward over the rows' backlog.
    #: 0 and 0: not measured (no catch-up charged).
    draft_prefill_fixed_ms: float = 0.0
    draft_prefill_ms_per_token: float = 0.0
    #: Measured plain steps at 1, 2, … rows (``()``: the line above): the plain step is then piecewise
    #: linear through them (:func:`plain_step_line`), ``plain_per_seq_ms`` per row beyond the last.
    plain_ms_by_batch: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            for v in value if isinstance(value, tuple) else (value,):
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"{name} must be finite and >= 0, got {v}")

    def plain_line(self, batch: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
        """(fixed, per row) of the plain step's line at ``batch`` (see :func:`plain_step_line`)."""
        return plain_step_line(self.plain_ms_by_batch, self.plain_fixed_ms, self.plain_per_seq_ms, batch)


def speculative_step_line(cost: Any, totals: StepTotals) -> tuple[float, float]:
    """The model's (fixed ms, per-row ms) of the mean speculative step in ``totals`` (what those steps held:
    draft forwards, verify widths, drafted rows), the line a window's measured mean step is set against."""
    n, rows = totals.steps, totals.rows
    fixed = (n * cost.verify_fixed_ms + totals.draft_forwards * cost.draft_fixed_ms) / n
    per_row = (rows * cost.verify_per_seq_ms + totals.verify_tokens * cost.verify_per_token_ms
               + totals.drafted_row_forwards * cost.draft_per_seq_ms) / rows
    return fixed, per_row


def plain_step_line(by_batch: Sequence[float], fixed_ms: float, per_row_ms: float,
                    batch: np.ndarray | float) -> tuple[np.ndarray, np.ndarray]:
    """(fixed, per row) ms of the segment of the plain step that holds ``batch``: step = fixed + per_row · B.

    ``by_batch[i]`` is the measured step at i + 1 rows; between two measured batches the step is the
    straight line through them (below one row, the first segment's); from the last one on it grows by
    ``per_row_ms`` per row. Empty ``by_batch``: the line ``fixed_ms + per_row_ms · B`` everywhere. Why a
    table: on the default pair the plain step is concave in the batch (session 16: 51.6 / 73.3 / 91.0 /
    99.0 / 113.4 ms at 1 / 2 / 3 / 4 / 8 rows), so the least-squares line is 26 % high at one row and
    11 % low at three, and a correction learned at one row then under-predicts three by ~30 %.
    """
    b = np.asarray(batch, dtype=float)
    n = len(by_batch)
    if n == 0:
        return np.full(b.shape, fixed_ms), np.full(b.shape, per_row_ms)
    table = np.asarray(by_batch, dtype=float)
    beyond = b >= n
    if n == 1:
        lo = np.zeros(b.shape, dtype=np.int64)
        slope = np.zeros(b.shape)
    else:
        lo = np.clip(np.floor(b).astype(np.int64), 1, n - 1)  # segment [lo, lo + 1] in rows
        slope = table[lo] - table[lo - 1]
        lo = lo - 1
    slope = np.where(beyond, per_row_ms, slope)
    anchor_rows = np.where(beyond, float(n), lo + 1.0)
    anchor_ms = np.where(beyond, table[n - 1], table[lo])
    return anchor_ms - slope * anchor_rows, slope


@dataclass(frozen=True, slots=True)
class OperatingModel:
    """Operating points over (T, k) (k = 0 included) for one divergence, and the step cost."""

    points: tuple[OperatingPoint, ...]
    cost: StepCost
    source: str = ""
    #: Quantiles of per-request acceptance (ascending, in (0, 1)) the points' ``tokens_per_step_by_quantile``
    #: are at (``()``: none).
    request_quantiles: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if not any(p.k == 0 for p in self.points):
            raise ValueError("points: the model needs a k = 0 point (plain decoding)")
        if any(p.k == 0 and (p.tokens_per_step != 1.0 or p.mean_distortion != 0.0) for p in self.points):
            raise ValueError("points: k = 0 emits one token per step without distortion")
        lengths = {len(p.tokens_per_step_by_batch) for p in self.points if p.k > 0}
        if len(lengths) > 1:
            raise ValueError(f"points: tokens_per_step_by_batch must have one length for every k > 0 point, got {sorted(lengths)}")
        rq = self.request_quantiles
        if any(not (0.0 < q < 1.0) for q in rq) or any(b <= a for a, b in zip(rq, rq[1:], strict=False)):
            raise ValueError(f"request_quantiles must ascend inside (0, 1), got {list(rq)}")
        for p in self.points:
            if p.tokens_per_step_by_quantile and len(p.tokens_per_step_by_quantile) != len(rq):
                raise ValueError(f"points: tokens_per_step_by_quantile has {len(p.tokens_per_step_by_quantile)} "
                                 f"entries at T={p.threshold}, k={p.k}; request_quantiles has {len(rq)}")

    def hard_curve(self, k: int, quantile: float) -> np.ndarray | None:
        """Tokens per step of the request at ``quantile`` of per-request acceptance, per T point of ``k``
        (sorted by T, as :meth:`curve`): linear in the quantile between the model's, held beyond them. None
        where the model has no per-request spread (or a point of ``k`` lacks it)."""
        if not (0.0 < quantile < 1.0):
            raise ValueError(f"quantile must be in (0, 1), got {quantile}")
        pts = sorted((p for p in self.points if p.k == k), key=lambda p: p.threshold)
        if not pts:
            raise ValueError(f"k={k} is not in the model; known: {self.draft_lengths}")
        if k == 0:
            return np.ones(len(pts))
        if not self.request_quantiles or any(not p.tokens_per_step_by_quantile for p in pts):
            return None
        return np.array([np.interp(quantile, self.request_quantiles, p.tokens_per_step_by_quantile) for p in pts])

    @property
    def batch_sizes(self) -> int:
        """Batch sizes the points carry tokens for (0: acceptance does not depend on the batch)."""
        return max((len(p.tokens_per_step_by_batch) for p in self.points), default=0)

    def batch_curve(self, k: int) -> np.ndarray | None:
        """Tokens per step [T points sorted by T, batch 1..:attr:`batch_sizes`] at draft length ``k``;
        None when the model has no batch dependence."""
        n_b = self.batch_sizes
        if n_b == 0:
            return None
        pts = sorted((p for p in self.points if p.k == k), key=lambda p: p.threshold)
        if not pts:
            raise ValueError(f"k={k} is not in the model; known: {self.draft_lengths}")
        return np.array([p.tokens_per_step_by_batch or (p.tokens_per_step,) * n_b for p in pts])

    @property
    def draft_lengths(self) -> list[int]:
        return sorted({p.k for p in self.points})

    def curve(self, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(T, tokens per step, distortion) at draft length ``k``, sorted by T."""
        pts = sorted((p for p in self.points if p.k == k), key=lambda p: p.threshold)
        if not pts:
            raise ValueError(f"k={k} is not in the model; known: {self.draft_lengths}")
        return (
            np.array([p.threshold for p in pts]),
            np.array([p.tokens_per_step for p in pts]),
            np.array([p.mean_distortion for p in pts]),
        )

    def to_dict(self) -> dict[str, Any]:
        points = []
        for p in self.points:
            d = asdict(p)
            if not p.tokens_per_step_by_batch:
                del d["tokens_per_step_by_batch"]  # the files of models without batch dependence stay as they were
            else:
                d["tokens_per_step_by_batch"] = list(p.tokens_per_step_by_batch)
            if not p.tokens_per_step_by_quantile:
                del d["tokens_per_step_by_quantile"]
            else:
                d["tokens_per_step_by_quantile"] = list(p.tokens_per_step_by_quantile)
            points.append(d)
        cost = asdict(self.cost)
        if self.cost.plain_ms_by_batch:
            cost["plain_ms_by_batch"] = list(self.cost.plain_ms_by_batch)
        else:
            del cost["plain_ms_by_batch"]  # models without a measured plain-step table stay as they were
        out: dict[str, Any] = {"source": self.source, "cost": cost, "points": points}
        if self.request_quantiles:
            out["request_quantiles"] = list(self.request_quantiles)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OperatingModel:
        try:
            return cls(
                points=tuple(OperatingPoint(**{**p, "tokens_per_step_by_batch": tuple(p.get("tokens_per_step_by_batch", ())),
                                                "tokens_per_step_by_quantile": tuple(p.get("tokens_per_step_by_quantile", ()))})
                             for p in data["points"]),
                cost=StepCost(**{**data["cost"],
                                 "plain_ms_by_batch": tuple(data["cost"].get("plain_ms_by_batch", ()))}),
                source=str(data.get("source", "")),
                request_quantiles=tuple(float(q) for q in data.get("request_quantiles", ())),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"operating model: malformed ({exc})") from None

    @classmethod
    def load(cls, path: str | Path) -> OperatingModel:
        try:
            data = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ValueError(f"operating model file {str(path)!r} does not exist") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"operating model file {str(path)!r} is not valid JSON: {exc}") from None
        return cls.from_dict(data)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

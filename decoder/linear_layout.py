"""Small-batch weight layout: a second, transposed copy of a float ``nn.Linear`` weight for decode steps.

Why. A decode step multiplies a handful of rows (one per sequence, times k + 1 at verification) by every
weight of the model. On some CPU BLAS builds the ``[out, in]`` layout that ``F.linear`` reads is slow at a
few rows and the ``[in, out]`` layout fast: with torch 2.13's MKL on an AVX2 machine (session 16, 1 thread)
SmolLM2-135M's fp32 LM head (576 → 49152) took 8.1 / 17.6 / 26.4 ms at 1 / 2 / 3 rows through ``F.linear``
and 4.1 / 7.8 / 11.6 ms as ``x @ W_t``, while at 4+ rows ``F.linear`` was the faster (19 vs 26 ms). The
whole fp32 target stepped at 53 / 87 / 107 / 87 ms for 1 / 2 / 3 / 4 rows — not even monotone in the batch,
which no step-time model linear in the batch can follow. On other builds, shapes and dtypes the old
layout wins (bf16 on AVX2: ``x @ W_t`` was 10x slower), so nothing is assumed: :func:`tune_linear_layout`
times the model's forward in both layouts at 1..``max_rows`` rows when the model is loaded and keeps
the transposed copies only up to the row count where they stop being faster by ``min_gain``.

Cost: one more copy of each weight (the LM head's included; a tied embedding keeps its own layout).
The copy is a buffer, not a parameter: state dicts, ``parameters()`` and weight tying are unchanged.
Results differ from ``F.linear`` in float rounding only (another summation order), as two BLAS kernels do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

LAYOUTS = ("auto", "off", "transposed")


class SmallBatchLinear(torch.nn.Module):
    """An ``nn.Linear`` that multiplies inputs of at most ``max_rows`` rows by a transposed copy of its
    weight (``x @ W_t``, ``W_t`` contiguous ``[in, out]``) and larger ones through ``F.linear``
    (``max_rows`` 0: always ``F.linear``)."""

    weight_t: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, max_rows: int) -> None:
        super().__init__()
        if max_rows < 0:
            raise ValueError(f"max_rows must be >= 0, got {max_rows}")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: tying and state dicts see no change
        self.bias = linear.bias
        self.max_rows = max_rows
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        if x.numel() <= self.max_rows * self.in_features:
            out = torch.matmul(x, self.weight_t)
            return out if self.bias is None else out + self.bias
        return torch.nn.functional.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, max_rows={self.max_rows}"


@dataclass
class LayoutReport:
    """What :func:`tune_linear_layout` did: the model forward's best-of-N ms per row count in each
    layout (``auto``), the rows cut-over chosen (0: unchanged), and the bytes the copies take."""

    mode: str
    linear_ms: list[float] = field(default_factory=list)  # F.linear everywhere, at 1, 2, ... rows
    transposed_ms: list[float] = field(default_factory=list)  # the transposed copies, at 1, 2, ... rows
    max_rows: int = 0
    layers: int = 0
    extra_bytes: int = 0

    def describe(self) -> str:
        if self.layers == 0:
            return f"linear layout {self.mode}: unchanged"
        return (f"linear layout {self.mode}: {self.layers} layers transposed up to {self.max_rows} rows "
                f"(+{self.extra_bytes / 2**20:.0f} MiB)")


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm: first calls allocate and pick kernels
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1000.0


def tune_linear_layout(
    model: torch.nn.Module,
    mode: str = "auto",
    max_rows: int = 3,
    min_gain: float = 0.1,
    repeats: int = 3,
) -> LayoutReport:
    """Give ``model``'s fp32 ``nn.Linear`` layers the small-batch layout where it pays, in place.

    ``mode``: ``"auto"`` times one forward of the whole model over one position at 1, 2, ..., ``max_rows``
    rows in both layouts (best of ``repeats``), and keeps the copies up to the largest row count m at
    which they are no slower at any of 1..m rows and ``min_gain`` faster over them together (none: the
    model is left as it was). The whole
    model, not each weight: alone and cache-hot a small weight shows no difference, streamed from memory
    with the rest of the model it does (session 16: SmolLM2-135M's body layers made 10 of the 26 ms the
    layout saved at 2 rows). ``"transposed"`` applies it at ``max_rows`` without timing (tests, and machines
    known to want it); ``"off"`` leaves the model as it is. Only fp32 layers: on AVX2, bf16 ``x @ W_t`` was
    10x slower than ``F.linear``. Quantized layers are left alone.
    """
    if mode not in LAYOUTS:
        raise ValueError(f"unknown linear layout {mode!r}; expected one of {', '.join(LAYOUTS)}")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    report = LayoutReport(mode=mode)
    targets = [
        (parent, name, child)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if type(child) is torch.nn.Linear and child.weight.dtype == torch.float32
    ]
    if mode == "off" or not targets:
        return report
    wrapped = [SmallBatchLinear(linear, max_rows) for _, _, linear in targets]
    for (parent, name, _), layer in zip(targets, wrapped, strict=True):
        setattr(parent, name, layer)
    cut = max_rows
    if mode == "auto":
        cut = _timed_cut_over(model, wrapped, report, max_rows, min_gain, repeats)
    if cut == 0:  # the copies do not pay here: put the plain layers back
        for parent, name, linear in targets:
            setattr(parent, name, linear)
        return report
    for layer in wrapped:
        layer.max_rows = cut
    report.max_rows, report.layers = cut, len(wrapped)
    report.extra_bytes = sum(layer.weight_t.numel() * layer.weight_t.element_size() for layer in wrapped)
    return report


def _timed_cut_over(model: torch.nn.Module, wrapped: list[SmallBatchLinear], report: LayoutReport,
                    max_rows: int, min_gain: float, repeats: int) -> int:
    """Rows up to which the transposed copies pay in ``model``'s forward (:func:`choose_cut_over`; 0:
    never). The timings go into ``report``."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        for rows in range(1, max_rows + 1):
            ids = torch.zeros(rows, 1, dtype=torch.long, device=device)

            def forward(ids: torch.Tensor = ids) -> object:
                return model(input_ids=ids, use_cache=False)

            for layer_rows, timings in ((0, report.linear_ms), (rows, report.transposed_ms)):
                for layer in wrapped:
                    layer.max_rows = layer_rows
                timings.append(_best_ms(forward, repeats))
    return choose_cut_over(report.linear_ms, report.transposed_ms, min_gain)


def choose_cut_over(linear_ms: list[float], transposed_ms: list[float], min_gain: float,
                    tolerance: float = 0.03) -> int:
    """The largest m such that ``transposed_ms`` is at most ``tolerance`` above ``linear_ms`` at every one
    of the first m entries (rows 1..m) and ``min_gain`` below it summed over them; 0 when there is none."""
    if len(linear_ms) != len(transposed_ms):
        raise ValueError(f"timings of different lengths: {len(linear_ms)} and {len(transposed_ms)}")
    cut = 0
    for m in range(1, len(linear_ms) + 1):
        if transposed_ms[m - 1] > (1.0 + tolerance) * linear_ms[m - 1]:
            break
        if sum(transposed_ms[:m]) <= (1.0 - min_gain) * sum(linear_ms[:m]):
            cut = m
    return cut

"""What every benchmark script ends with: its JSON report on stdout and, where asked, in a file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def emit(report: Any, out: str | Path | None, indent: int = 1, default: Any = None) -> str:
    """Print ``report`` as JSON and write it (newline-terminated) to ``out``, its folder made; None: print only.
    Returns the text."""
    text = json.dumps(report, indent=indent, default=default)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
    return text


def host() -> dict[str, Any]:
    """Where a figure was measured, for its report: torch's CPU kernel level, the machine and its load."""
    import os
    import platform

    import torch  # here, not at the top: the simulator-only scripts that use emit() need no torch

    return {
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
        "load_average": [round(x, 2) for x in os.getloadavg()],
    }

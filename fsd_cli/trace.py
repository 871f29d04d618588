"""``fsd trace fetch``: download the service's traffic recording (a trace CSV for ``fsd sim --trace``).

    fsd trace fetch --url http://127.0.0.1:8000 --out results/recording.csv

The admin token comes from ``--token`` or ``$FSD_ADMIN_TOKEN``. The recording holds arrival times, token
counts, tier, requested max_tokens and status per request — never prompt or output text.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("trace", help="fetch the service's traffic recording",
                                   description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = parser.add_subparsers(dest="trace_action", metavar="ACTION")
    actions.required = True
    fetch = actions.add_parser("fetch", help="GET /v1/fsd/recording into a CSV file")
    fetch.add_argument("--url", default="http://127.0.0.1:8000", help="service base URL")
    fetch.add_argument("--out", required=True, help="CSV file to write")
    fetch.add_argument("--token", help="admin token (default: $FSD_ADMIN_TOKEN)")
    fetch.add_argument("--timeout", type=float, default=60.0, help="seconds")
    fetch.set_defaults(func=fetch_recording)


def fetch_recording(args: argparse.Namespace) -> int:
    import httpx

    from sim.trace import read_azure_trace

    token = args.token or os.environ.get("FSD_ADMIN_TOKEN")
    if not token:
        raise ValueError("--token: the recording is admin-only; pass --token or set FSD_ADMIN_TOKEN")
    url = args.url.rstrip("/") + "/v1/fsd/recording"
    try:
        r = httpx.get(url, headers={"authorization": f"Bearer {token}"}, timeout=args.timeout)
    except httpx.HTTPError as exc:
        raise ValueError(f"--url {args.url!r}: {type(exc).__name__}: {exc}") from None
    if r.status_code != 200:
        try:
            message = r.json()["error"]["message"]
        except Exception:
            message = r.text[:200]
        print(f"fsd trace fetch: {url} answered {r.status_code}: {message}", file=sys.stderr)
        return 1
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(r.text, encoding="utf-8")
    rows = r.text.count("\n") - 1
    if rows <= 0:
        print(f"wrote {out}: no requests recorded yet")
        return 0
    trace = read_azure_trace(out)
    statuses: dict[str, int] = {}
    for s in trace.status or ():
        statuses[s] = statuses.get(s, 0) + 1
    print(f"wrote {out}: {len(trace)} requests over {float(trace.arrival_s[-1]):.1f} s; "
          f"statuses {dict(sorted(statuses.items()))}")
    return 0

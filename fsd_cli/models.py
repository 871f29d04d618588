"""``fsd models list|fetch``: which shipped model pairs exist, and making one available offline."""

from __future__ import annotations

import argparse


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("models", help="list or fetch the registered draft/target model pairs")
    actions = parser.add_subparsers(dest="models_action", metavar="ACTION")
    actions.required = True

    list_parser = actions.add_parser("list", help="registered pairs with their status and size on disk")
    list_parser.set_defaults(func=list_models)

    fetch_parser = actions.add_parser(
        "fetch", help="download, verify and convert a pair once (idempotent; a fetched pair is a no-op)"
    )
    fetch_parser.add_argument("name", help="pair name, see `fsd models list`")
    fetch_parser.set_defaults(func=fetch_model)


def list_models(args: argparse.Namespace) -> int:
    from decoder.models import cache_dir
    from decoder.pairs import DEFAULT_PAIR, PAIRS, pair_status

    rows = []
    for name in PAIRS:
        status = pair_status(name)
        label = f"{name} (default)" if name == DEFAULT_PAIR else name
        rows.append((label, status.state, _human_bytes(status.size_bytes), status.description))
    headers = ("PAIR", "STATUS", "ON DISK", "DESCRIPTION")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers[:3])]
    for row in (headers, *rows):
        print("  ".join(cell.ljust(width) for cell, width in zip(row[:3], widths, strict=True)) + "  " + row[3])
    print(f"\ncache: {cache_dir()} (set FSD_CACHE_DIR to move it)")
    return 0


def fetch_model(args: argparse.Namespace) -> int:
    import sys

    from decoder.model_fetch import FetchError
    from decoder.pairs import fetch_pair

    try:
        status = fetch_pair(args.name)
    except FetchError as exc:
        print(f"fsd models fetch: {exc}", file=sys.stderr)
        return 1
    print(f"{status.name}: {status.state}, {_human_bytes(status.size_bytes)} on disk")
    return 0 if status.available else 1


def _human_bytes(size_bytes: int) -> str:
    if size_bytes <= 0:
        return "-"
    value = float(size_bytes)
    for unit in ("B", "KB", "MB"):
        if value < 1000:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1000
    return f"{value:.2f} GB"

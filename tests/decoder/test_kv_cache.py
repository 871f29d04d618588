"""BatchKVCache bookkeeping on its own: geometric growth and host-side metadata."""

from __future__ import annotations

import torch

from decoder.kv_cache import BatchKVCache


def write(cache: BatchKVCache, q: int, valid: torch.Tensor | None = None) -> None:
    """One forward's worth of writes: q new slots for every row, all layers."""
    batch = cache.batch_size
    cache.prepare(valid if valid is not None else torch.ones(batch, q, dtype=torch.bool))
    for layer in range(len(cache.layers)):
        cache.update(torch.randn(batch, 2, q, 4), torch.randn(batch, 2, q, 4), layer)
    cache.commit()


def test_buffers_grow_geometrically_so_copying_stays_linear() -> None:
    cache = BatchKVCache(num_layers=2, batch_size=3)
    capacities = []
    for _ in range(2000):
        write(cache, 1)
        capacity = cache.layers[0].keys.shape[2]  # type: ignore[union-attr]
        if not capacities or capacity != capacities[-1]:
            capacities.append(capacity)
    assert cache.length == 2000
    # fixed 64-slot growth would reallocate ~31 times (and copy ~quadratically); x1.5 needs about log_1.5(2000/64)
    assert len(capacities) <= 12, capacities
    assert all(b >= 1.5 * a - 1 for a, b in zip(capacities, capacities[1:], strict=False)), capacities


def test_metadata_stays_on_the_host_and_rollback_takes_host_lists() -> None:
    cache = BatchKVCache(num_layers=1, batch_size=2)
    write(cache, 3)
    write(cache, 4, torch.tensor([[True, True, True, True], [True, True, False, False]]))
    cache.reject_tail(4, [1, 2])  # row 0 keeps 1 of the 4 new slots, row 1 its 2 real ones
    assert cache.valid.device.type == "cpu" and cache.row_lengths.device.type == "cpu"
    assert cache.row_lengths.tolist() == [4, 5]
    assert cache.num_holes == 1  # row 0's slot 4; slots 5-6 are cropped (no row keeps them)
    assert cache.length == 5
    cache.select_rows([1])
    assert cache.batch_size == 1 and cache.row_lengths.tolist() == [5] and cache.length == 5

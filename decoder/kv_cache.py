"""A batched, ragged KV cache for speculative decoding with Hugging Face decoder models.

Layout. Every layer keeps one preallocated key and one value buffer of shape
``[batch, kv_heads, capacity, head_dim]``. The slot (sequence) axis is shared by all rows: a forward
over ``q`` new tokens writes slots ``[length, length + q)`` for every row at once, in place. Which
slots hold a real token of a row is tracked by ``valid[batch, capacity]``; a row's tokens are its
valid slots in slot order. Keys are stored *after* rotary embedding with each row's own logical
positions, so where a token sits on the slot axis never matters — only the attention mask does.

Why holes. After verification each row keeps a different number of the k+1 slots just written
(ragged acceptance). Rejected slots are marked invalid ("holes") instead of being moved. Slots that
are invalid for every row at the end are cropped for free (the common case at batch size 1, where
there are never holes). When holes pile up, :meth:`BatchKVCache.compact` gathers each row's valid
slots into a right-aligned, left-padded layout.

Host-side bookkeeping. ``valid`` and ``row_lengths`` live on the host (CPU): every decision (how many
holes, what to crop, the compaction order, positions) is made there without a device synchronisation;
the mask and the gather/select indices are copied to the model's device explicitly. Only the key/value
buffers live on the device.

Masks. The model receives an explicit 4-D boolean mask (``True`` = attend) built by
:meth:`BatchKVCache.attention_mask`; transformers passes 4-D masks through unchanged. Every query
row always sees at least itself, so SDPA never meets a fully masked row (which would give NaN).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer

# Buffers grow geometrically (x1.5, at least this many slots), so copying stays linear in the length.
_GROWTH_SLOTS = 64
_GROWTH_FACTOR = 1.5


def _grown_capacity(needed: int, current: int) -> int:
    return max(needed + _GROWTH_SLOTS, int(current * _GROWTH_FACTOR))


# transformers' cache layers are unannotated (their __init_subclass__ and __init__ included).
class _SlotLayer(DynamicLayer):  # type: ignore[no-untyped-call]
    """One layer's preallocated buffers; all writes go through :meth:`BatchKVCache.update`."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # DynamicLayer.__init__ is unannotated
        self.keys: torch.Tensor | None = None  # [batch, kv_heads, capacity, head_dim]
        self.values: torch.Tensor | None = None


class BatchKVCache(Cache):
    """KV cache of one model for a batch of independent sequences (see the module docstring)."""

    def __init__(self, num_layers: int, batch_size: int, device: torch.device | str = "cpu") -> None:
        slot_layers = [_SlotLayer() for _ in range(num_layers)]
        super().__init__(layers=list(slot_layers))
        # The same layer objects as Cache.layers (which transformers types as a union of every layer kind),
        # typed as what they are here. Only Cache.update appends to `layers`, and it is overridden below.
        self._slot_layers: list[_SlotLayer] = slot_layers
        self.device = torch.device(device)
        self.length = 0  # slots in use, shared by all rows
        self.valid = torch.zeros(batch_size, 0, dtype=torch.bool)  # [batch, length], host
        self.row_lengths = torch.zeros(batch_size, dtype=torch.long)  # valid slots per row, host
        self._pending_valid: torch.Tensor | None = None
        self.compactions = 0  # how often holes were gathered away (observability, tests)

    # ----------------------------------------------------------------- shape
    @property
    def batch_size(self) -> int:
        return int(self.valid.shape[0])

    @property
    def num_holes(self) -> int:
        return self.batch_size * self.length - int(self.row_lengths.sum())

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.length

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.length + query_length, 0

    # -------------------------------------------------------------- forward
    def prepare(self, new_valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prepare a forward over ``q`` new tokens per row.

        ``new_valid``: ``[batch, q]`` bool on the host, False for padding queries (their slots become
        holes). Returns ``(position_ids [batch, q], attention_mask [batch, 1, q, length + q] or None)``,
        both on the cache's device. Call :meth:`commit` after the forward.
        """
        new_valid = new_valid.cpu()  # a host tensor already in the engine: no copy, no sync
        batch, q = new_valid.shape
        if batch != self.batch_size:
            raise ValueError(f"new_valid has {batch} rows, the cache has {self.batch_size}")
        # Each row's new tokens continue its own logical positions; padding borrows its neighbour's.
        positions = self.row_lengths[:, None] + new_valid.long().cumsum(1) - 1
        positions = positions.clamp_min(0).to(self.device)
        self._pending_valid = new_valid
        if q == 1 and self.num_holes == 0 and bool(new_valid.all()):
            # Nothing to mask: transformers then lets SDPA attend to everything, which is exact here
            # and skips materialising a mask and repeating the KV heads (GQA) every layer.
            return positions, None
        causal = torch.ones(q, q, dtype=torch.bool).tril()
        eye = torch.eye(q, dtype=torch.bool)
        new_part = causal & (new_valid[:, None, :] | eye)  # [batch, q, q]
        old_part = self.valid[:, None, :].expand(batch, q, self.length)  # [batch, q, length]
        mask = torch.cat([old_part, new_part], dim=2)[:, None]
        return positions, mask.to(self.device)

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new keys/values at slots ``[length, length + q)`` and return all slots so far."""
        layer = self._slot_layers[layer_idx]
        q = key_states.shape[2]
        end = self.length + q
        if layer.keys is None or layer.keys.shape[2] < end:
            current = 0 if layer.keys is None else layer.keys.shape[2]
            self._grow_layer(layer, key_states, value_states, _grown_capacity(end, current))
        assert layer.keys is not None and layer.values is not None
        layer.keys[:, :, self.length : end] = key_states
        layer.values[:, :, self.length : end] = value_states
        return layer.keys[:, :, :end], layer.values[:, :, :end]

    def commit(self) -> None:
        """Account for the tokens written by the forward that followed :meth:`prepare`."""
        if self._pending_valid is None:
            raise RuntimeError("commit() without prepare()")
        self.valid = torch.cat([self.valid, self._pending_valid], dim=1)
        self.row_lengths = self.row_lengths + self._pending_valid.sum(1)
        self.length += self._pending_valid.shape[1]
        self._pending_valid = None

    def _grow_layer(self, layer: _SlotLayer, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, _, dim = keys.shape
        new_keys = keys.new_zeros(batch, heads, capacity, dim)
        new_values = values.new_zeros(batch, heads, capacity, values.shape[-1])
        if layer.keys is not None and layer.values is not None:
            new_keys[:, :, : self.length] = layer.keys[:, :, : self.length]
            new_values[:, :, : self.length] = layer.values[:, :, : self.length]
        layer.keys, layer.values = new_keys, new_values
        layer.is_initialized = True

    # ------------------------------------------------------------- rollback
    def reject_tail(self, num_slots: int, keep: torch.Tensor | list[int]) -> None:
        """Roll back part of the last ``num_slots`` slots.

        ``keep``: ``[batch]`` (a tensor or host list), how many of those slots each row keeps (from the
        left); the rest become holes. Trailing slots that no row keeps are cropped.
        """
        keep = torch.as_tensor(keep, dtype=torch.long).cpu()
        start = self.length - num_slots
        offsets = torch.arange(num_slots)
        tail = self.valid[:, start:] & (offsets[None, :] < keep[:, None])
        self.row_lengths = self.row_lengths - (self.valid[:, start:].sum(1) - tail.sum(1))
        self.valid = torch.cat([self.valid[:, :start], tail], dim=1)
        self.crop_unused()

    def crop_unused(self) -> None:
        """Drop trailing slots that are holes in every row (free: nothing moves)."""
        used = self.valid.any(0).nonzero()
        new_length = int(used[-1]) + 1 if used.numel() else 0
        if new_length < self.length:
            self.length = new_length
            self.valid = self.valid[:, :new_length]

    def compact(self) -> None:
        """Gather every row's valid slots into a right-aligned (left-padded) layout."""
        new_length = int(self.row_lengths.max()) if self.batch_size else 0
        if new_length == self.length:
            return
        # A stable sort on validity puts each row's holes first and keeps its tokens in order.
        order = torch.sort(self.valid.to(torch.int8), dim=1, stable=True).indices[:, self.length - new_length :]
        order_on_device = order.to(self.device)
        for layer in self._slot_layers:
            if layer.keys is None or layer.values is None:
                continue
            index = order_on_device[:, None, :, None].expand(-1, layer.keys.shape[1], -1, layer.keys.shape[3])
            layer.keys[:, :, :new_length] = layer.keys[:, :, : self.length].gather(2, index)
            index = order_on_device[:, None, :, None].expand(-1, layer.values.shape[1], -1, layer.values.shape[3])
            layer.values[:, :, :new_length] = layer.values[:, :, : self.length].gather(2, index)
        self.valid = self.valid.gather(1, order)
        self.length = new_length
        self.compactions += 1

    # ------------------------------------------------------- rows join/leave
    def select_rows(self, rows: torch.Tensor | list[int]) -> None:
        """Keep only ``rows`` (a 1-D long index, best a host list or tensor), in that order."""
        rows = torch.as_tensor(rows, dtype=torch.long).cpu()
        rows_on_device = rows.to(self.device)
        for layer in self._slot_layers:
            if layer.keys is not None and layer.values is not None:
                layer.keys = layer.keys.index_select(0, rows_on_device)
                layer.values = layer.values.index_select(0, rows_on_device)
        self.valid = self.valid.index_select(0, rows)
        self.row_lengths = self.row_lengths.index_select(0, rows)
        self.crop_unused()

    def append_rows(self, other: BatchKVCache) -> None:
        """Append ``other``'s rows after this cache's rows, aligning both to the right."""
        new_length = max(self.length, other.length)
        capacity = _grown_capacity(new_length, 0)
        for mine, theirs in zip(self._slot_layers, other._slot_layers, strict=True):
            ref = mine if mine.keys is not None else theirs
            if ref.keys is None or ref.values is None:
                continue  # neither side has a token yet: buffers are made at the first write
            keys = ref.keys.new_zeros(self.batch_size + other.batch_size, ref.keys.shape[1], capacity, ref.keys.shape[3])
            values = ref.values.new_zeros(keys.shape[0], ref.values.shape[1], capacity, ref.values.shape[3])
            for src, batch_offset, src_length in (
                (mine, 0, self.length),
                (theirs, self.batch_size, other.length),
            ):
                if src.keys is None or src.values is None or src_length == 0:
                    continue
                rows = slice(batch_offset, batch_offset + src.keys.shape[0])
                slots = slice(new_length - src_length, new_length)
                keys[rows, :, slots] = src.keys[:, :, :src_length]
                values[rows, :, slots] = src.values[:, :, :src_length]
            mine.keys, mine.values = keys, values
            mine.is_initialized = True

        def right_align(valid: torch.Tensor) -> torch.Tensor:
            pad = valid.new_zeros(valid.shape[0], new_length - valid.shape[1])
            return torch.cat([pad, valid], dim=1)

        self.valid = torch.cat([right_align(self.valid), right_align(other.valid)], dim=0)
        self.row_lengths = torch.cat([self.row_lengths, other.row_lengths])
        self.length = new_length

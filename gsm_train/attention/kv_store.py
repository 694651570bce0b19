"""One layer's K or V for generation, in buffers allocated once for the cache's capacity.

With a compressor (`modules.kv_registry.KVCompressor`) every block but the newest is stored as it packs
it (for ASQ: cluster ids, residual codes, fp16 scales, fp16 prototypes), in fields sized for `capacity`
tokens; the newest block (1..block_size tokens) stays raw in `tail` [B, H, block_size, D], token p at
slot p - packed. A block is packed when the first token after it arrives, so a query always sees its
own block exactly, as training does. Without a compressor `tail` [B, H, capacity, D] holds every token.

How many tokens the store holds is the cache's `CacheLengths`, shared by every layer: on the host for
the PyTorch paths and the driver, on the device for the kernels and captured steps. A layer's cache holds
its K and V stores and the lengths as members of `attention.cache_protocol.LayerCache` (implemented by
`inference.cache.GSMCacheLayer`); this module sits in `attention/` because that protocol names its types
and `attention/` never imports `inference/` (it imports nothing else of `attention/`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.functional.gate_rope import GateKeyRotation
from gsm_train.kernels.packed_rows import PackedRows
from gsm_train.modules.errors import GSMError
from gsm_train.modules.kv_compressor import ASQCompressor, packed_together
from gsm_train.modules.kv_registry import KVCompressor
from gsm_train.quant import compute_dtype, stored_split, zeroed_fields


class CacheLengths:
    """Tokens a cache holds and how many of them are packed: `seq_len` / `packed_len` on the host, and
    `device` int32 [2] (the same two numbers) for kernels. During a forward, `before` is what the cache
    held when it started (where its new tokens are written). During a token step, `slots` int64 [2] on the
    device: where the new token goes, [seq_len - 1, seq_len - 1 - packed_len] (its position, and its slot
    in a compressed store's raw tail), computed once by `add_token` for every layer's writes and lookups.

    The one owner of these counters: they are read-only outside this class and change only through its
    methods (`add_chunk`, `add_token`, `follow_replayed_token`, `advance_packed`, `follow_packed`, `restore`,
    `clear`),
    so the host and device copies cannot drift apart by an assignment elsewhere (tests/test_cache_ownership.py
    checks)."""

    def __init__(self, device: torch.device) -> None:
        self._seq_len = 0
        self._packed_len = 0
        self._before = 0
        self.device = torch.zeros(2, dtype=torch.int32, device=device)
        self.slots = torch.zeros(2, dtype=torch.int64, device=device)

    @property
    def seq_len(self) -> int:
        return self._seq_len

    @property
    def packed_len(self) -> int:
        return self._packed_len

    @property
    def before(self) -> int:
        return self._before

    def add_chunk(self, tokens: int, block_size: int) -> None:
        """A call of `tokens` new tokens per row written eagerly (a prompt chunk): `before` is what was held,
        and both copies count the new length and its packed part, every whole block of `block_size` but the
        newest (`block_size` 0: nothing is packed)."""
        end = self._seq_len + tokens
        self._before = self._seq_len
        self._set(end, stored_split(end, block_size) if block_size else 0)

    def add_token(self) -> None:
        """One new token per row, capture-safe: the device copy advances by a device op (no host value
        enters it, so a CUDA graph captures it), the host copy follows, and `slots` names the token's
        slots. A full newest block is packed before (`advance_packed`)."""
        self._before, self._seq_len = self._seq_len, self._seq_len + 1
        self.device[0:1].add_(1)
        self.slots.add_(1)  # both slots move with the length (the packed part is unchanged)

    def follow_replayed_token(self) -> None:
        """A captured token step was replayed: its `add_token` advanced the device copy; the host's follows."""
        self._before, self._seq_len = self._seq_len, self._seq_len + 1

    def advance_packed(self, block_size: int) -> None:
        """The full newest block of `block_size` tokens is packed, on the device copy: by device ops (no host
        value enters it, so a CUDA graph captures it); the host's copy follows with `follow_packed`."""
        self.device[1:2].add_(block_size)
        self.slots[1:2].sub_(block_size)  # the newest token's slot in the tail moves back by the block

    def follow_packed(self, block_size: int) -> None:
        """`advance_packed` ran (eagerly or in a replayed graph): the host copy follows the device's."""
        self._packed_len += block_size

    def clear(self) -> None:
        """Back to an empty cache's counters, as `__init__` made them (in place: the device tensors a captured
        step reads stay the same)."""
        self._seq_len = self._packed_len = self._before = 0
        self.device.zero_()
        self.slots.zero_()

    def snapshot(self) -> tuple[int, int, int, Tensor]:
        """The counters as they are (`restore` puts them back), the device copy cloned."""
        return self._seq_len, self._packed_len, self._before, self.device.clone()

    def restore(self, saved: tuple[int, int, int, Tensor]) -> None:
        """The counters as `snapshot` took them (of this cache, or of another on the same device)."""
        self._seq_len, self._packed_len, self._before = saved[0], saved[1], saved[2]
        self.device.copy_(saved[3])
        self._set_slots()

    def _set(self, seq_len: int, packed_len: int) -> None:
        """Both copies to these values (eager code; a captured step advances the device copy itself)."""
        self._seq_len, self._packed_len = seq_len, packed_len
        self.device.copy_(_host_copy([seq_len, packed_len], self.device), non_blocking=True)
        self._set_slots()

    def _set_slots(self) -> None:
        """`slots` from the host counters (eager; `add_token` advances them on the device)."""
        newest = self._seq_len - 1
        self.slots.copy_(_host_copy([newest, newest - self._packed_len], self.slots), non_blocking=True)


def _host_copy(values: list[int], like: Tensor) -> Tensor:
    """`values` as a host tensor of `like`'s dtype, to copy into `like`: in pinned memory where `like` is on a
    GPU, so a non-blocking copy returns at once (from pageable memory CUDA first waits for the stream, which
    left the GPU idle between a prompt's layers); PyTorch keeps a pinned tensor's memory until its copy ran."""
    host = torch.tensor(values, dtype=like.dtype)
    return host.pin_memory() if like.is_cuda else host


class KVStore:
    """K or V of one layer, [B, H, capacity, D], packed by `compressor` (or raw when it is None). Its buffers
    (`buffer_specs`: the raw tail and the compressor's fields) are zeroed views the cache hands it (one fill
    for a whole layer), or made here (one fill for the store)."""

    def __init__(
        self,
        compressor: KVCompressor | None,
        batch: int,
        heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype,
        device: torch.device,
        lengths: CacheLengths,
        buffers: dict[str, Tensor] | None = None,
    ) -> None:
        self.compressor, self.heads, self.capacity, self.lengths = compressor, heads, capacity, lengths
        if buffers is None:
            buffers = zeroed_fields(KVStore.buffer_specs(compressor, batch, heads, head_dim, capacity, dtype), device)
        self.tail = buffers["tail"]
        fields = {name: buffer for name, buffer in buffers.items() if name != "tail"}
        self.fields: dict[str, Tensor] | None = fields if compressor is not None else None

    @staticmethod
    def buffer_specs(
        compressor: KVCompressor | None, batch: int, heads: int, head_dim: int, capacity: int, dtype: torch.dtype
    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of a store's buffers: `tail` (raw rows: every token without a compressor, the
        newest block with one) and the compressor's fields (`field_specs`). GSMError for a capacity that is
        not a whole number of the compressor's blocks."""
        if compressor is None:
            return {"tail": ((batch, heads, capacity, head_dim), dtype)}
        if capacity % compressor.block_size:
            raise GSMError(
                f"a cache's capacity ({capacity}) must be a whole number of blocks of "
                f"{compressor.block_size}; round it up"
            )
        tail = {"tail": ((batch, heads, compressor.block_size, head_dim), dtype)}
        return tail | compressor.field_specs(batch, heads, capacity)

    def _field_writes(self, packed: dict[str, Tensor], start: int) -> list[tuple[Tensor, Tensor]]:
        """Where `pack_blocks` fields of whole blocks go at token `start`: (the store's field from there, the
        field) pairs, for `write_all`."""
        pairs = []
        for name, field in packed.items():
            at = start // (self.capacity // self.fields[name].shape[2])  # 1 entry per token, or per block
            pairs.append((self.fields[name][:, :, at : at + field.shape[2]], field))
        return pairs

    def append(self, states: Tensor) -> Tensor | None:
        """Store new tokens [B, H', n, D] (the first `heads` heads of H') after the `lengths.before` held:
        eagerly, with host lengths (a prompt chunk, or a token outside a captured step). With a compressor,
        returns the raw rows [B, H, m, D] it packed from: the tail's tokens held before, then the new ones
        (positions `stored_split(before)` .. end); None without one."""
        raw = self._joined(states)
        if raw is not None:
            self._store_joined(raw)
        return raw

    def _joined(self, states: Tensor) -> Tensor | None:
        """`append`'s first half: without a compressor the new tokens stored (None); with one, the raw rows
        since the last block packed before the call (the tail's tokens held, then the new ones)."""
        states = states[:, : self.heads].to(self.tail.dtype)
        start, end = self.lengths.before, self.lengths.seq_len
        if end > self.capacity:
            raise GSMError(
                f"the GSM cache holds {self.capacity} tokens and this call would make it {end}; "
                "create it with a larger capacity (GSMCache(model, capacity=...))"
            )
        if self.compressor is None:
            self.tail[:, :, start:end] = states
            return None
        held = start - stored_split(start, self.compressor.block_size)
        return torch.cat((self.tail[:, :, :held], states), dim=2) if held else states

    def _store_joined(self, raw: Tensor, packed: dict[str, Tensor] | None = None) -> None:
        """`append`'s second half: `_joined`'s rows stored, the whole blocks they complete but the newest
        packed (`packed`: those blocks' `pack_blocks` fields, made already), the rest into the tail."""
        whole = self._blocks_completed()
        if whole:
            fields = packed if packed is not None else self.compressor.pack_blocks(raw[:, :, :whole])
            write_all(self._field_writes(fields, self._blocks_start()))
        self._store_tail(raw, whole)

    def _store_tail(self, raw: Tensor, whole: int) -> None:
        """`_joined`'s rows after its first `whole` (those of whole blocks) into the tail."""
        newest = raw[:, :, whole:]
        self.tail[:, :, : newest.shape[2]] = newest

    def _blocks_start(self) -> int:
        """The first token of the whole blocks the call in progress completes (`_blocks_completed`)."""
        return stored_split(self.lengths.before, self.compressor.block_size)

    def _blocks_completed(self) -> int:
        """Tokens of the whole blocks the call in progress completes (its `_joined` rows' first ones, which
        `_store_joined` packs): those packed after it less those packed before it."""
        block = self.compressor.block_size
        return stored_split(self.lengths.seq_len, block) - stored_split(self.lengths.before, block)

    def write_newest(self, state: Tensor) -> None:
        """Store one new token [B, H', 1, D] at the slot the device lengths name (capture-safe: no host
        value enters it). The cache has packed a full tail before (`GSMCache.begin_forward`)."""
        slots = self.lengths.slots
        slot = slots[1:2] if self.compressor is not None else slots[0:1]
        self.tail.index_copy_(2, slot, state[:, : self.heads].to(self.tail.dtype))

    def write_block(self, packed: dict[str, Tensor], tokens: Tensor, block: Tensor) -> None:
        """One block's `pack_blocks` fields into the store at the token positions `tokens` (int64
        [block_size]) and block index `block` (int64 [1]), both on the device: index writes, no host value
        (capture-safe). A field holds an entry per token or per block (`per_entry`)."""
        for name, field in packed.items():
            per_entry = self.capacity // self.fields[name].shape[2]
            self.fields[name].index_copy_(2, tokens if per_entry == 1 else block, field)

    def gather(self, index: Tensor) -> Tensor:
        """Rows [B, H, k, D] at positions `index` [B, H, k] (each below `lengths.seq_len`), dequantized, in
        the tail's dtype (host lengths: the PyTorch path)."""
        packed_len = self.lengths.packed_len if self.compressor is not None else 0
        dim = self.tail.shape[-1]
        in_tail = (index - packed_len).clamp(0, self.tail.shape[2] - 1)
        rows = torch.gather(self.tail, 2, in_tail.unsqueeze(-1).expand(*index.shape, dim))
        if packed_len == 0:
            return rows
        at = index.clamp_max(packed_len - 1)
        packed_rows = self.compressor.gather_packed(self.fields, at, compute_dtype(rows)).to(rows.dtype)
        return torch.where((index < packed_len).unsqueeze(-1), packed_rows, rows)

    def packed_prefix(self, end: int) -> Tensor:
        """Rows [B, H, end, D] of positions [0, end), every one packed (`end` <= `lengths.packed_len`),
        dequantized in the tail's dtype: what `gather` gives for them, without reading the tail or choosing
        between it and the packed rows (ASQ's fields sliced, not gathered: `ASQCompressor.prefix_rows`)."""
        if end == 0:
            return self.tail[:, :, :0]
        if isinstance(self.compressor, ASQCompressor):
            return self.compressor.prefix_rows(self.fields, end, compute_dtype(self.tail)).to(self.tail.dtype)
        batch, heads = self.tail.shape[:2]
        positions = torch.arange(end, device=self.tail.device).expand(batch, heads, -1)
        return self.compressor.gather_packed(self.fields, positions, compute_dtype(self.tail)).to(self.tail.dtype)

    def all_rows(self) -> Tensor:
        """Every token held [B, H, S, D], dequantized."""
        batch, heads = self.tail.shape[:2]
        positions = torch.arange(self.lengths.seq_len, device=self.tail.device).expand(batch, heads, -1)
        return self.gather(positions)

    def packed_rows(self) -> PackedRows | None:
        """What the fused decode kernel reads (`kernels.packed_rows.PackedRows`); None where it cannot read
        this store (a compressor other than ASQ)."""
        asq = self.compressor
        if asq is None:
            return PackedRows(self.tail, self.lengths.device)
        if not isinstance(asq, ASQCompressor):
            return None
        signs = asq.rotation_signs if asq.rotate_residuals else None
        fields = self.fields
        return PackedRows(
            self.tail,
            self.lengths.device,
            fields["ids"],
            fields["residual"],
            fields["scales"],
            fields["prototypes"],
            asq.quant_bits,
            asq.cluster_num,
            asq.block_size,
            signs,
        )

    def nbytes(self) -> int:
        """Bytes the tokens held occupy (what the byte account counts; the buffers are sized for capacity)."""
        batch, heads, _, dim = self.tail.shape
        raw_tokens = self.lengths.seq_len - (self.lengths.packed_len if self.compressor is not None else 0)
        held = batch * heads * raw_tokens * dim * self.tail.element_size()
        for field in (self.fields or {}).values():
            per_entry = self.capacity // field.shape[2]
            entries = self.lengths.packed_len // per_entry
            held += field[:, :, :entries].numel() * field.element_size()
        return held

    def allocated_bytes(self) -> int:
        """Bytes the store's buffers take on the device."""
        return sum(t.numel() * t.element_size() for t in [self.tail, *(self.fields or {}).values()])


def write_all(pairs: list[tuple[Tensor, Tensor]]) -> None:
    """Copy each pair's source into its destination (same shape; any dtypes and strides), in one
    `torch._foreach_copy_`: one host call for all, where a copy each costs the host an eager op each, which is
    what a launch-bound prefill waits on."""
    if pairs:
        torch._foreach_copy_([destination for destination, _ in pairs], [source for _, source in pairs])


def packed_fields(compressors: list[KVCompressor], rows: list[Tensor]) -> list[dict[str, Tensor]]:
    """Each compressor's `pack_blocks` fields of its whole blocks `rows[i]`: from one encoding of all of them
    where `modules.kv_compressor.packed_together` takes them (ASQ compressors that differ at most in their
    bits: about the ops of one), each alone otherwise."""
    together = packed_together(compressors, rows)
    if together is not None:
        return together
    return [compressor.pack_blocks(part) for compressor, part in zip(compressors, rows, strict=True)]


def append_pair(
    k_store: KVStore, v_store: KVStore, keys: Tensor, values: Tensor
) -> tuple[Tensor | None, Tensor | None]:
    """`(k_store.append(keys), v_store.append(values))`: the same stores and results, with the blocks both
    complete packed in one encoding where their compressors allow (`packed_fields`): about two thirds of
    the encodings' kernels of a prompt chunk."""
    k_raw, v_raw = k_store._joined(keys), v_store._joined(values)
    pair: list[dict[str, Tensor] | None] = [None, None]
    if k_raw is not None and v_raw is not None:
        whole = k_store._blocks_completed()
        if whole:
            pair = packed_fields([k_store.compressor, v_store.compressor], [k_raw[:, :, :whole], v_raw[:, :, :whole]])
    for store, raw, packed in zip((k_store, v_store), (k_raw, v_raw), pair, strict=True):
        if raw is not None:
            store._store_joined(raw, packed)
    return k_raw, v_raw


def pack_tails(k_store: KVStore, v_store: KVStore, tokens: Tensor, block: Tensor) -> None:
    """Pack the full tails (newest blocks) of a layer's K and V stores at token positions `tokens` and block
    index `block` (`KVStore.write_block`; read from the device lengths by the cache), in one encoding where
    their compressors allow (`packed_fields`). Device ops only, of fixed shapes: a CUDA graph captures it
    (`inference.decode_graph.CapturedPack`)."""
    pair = packed_fields([k_store.compressor, v_store.compressor], [k_store.tail, v_store.tail])
    for store, packed in zip((k_store, v_store), pair, strict=True):
        store.write_block(packed, tokens, block)


PACK_TOGETHER_BYTES = 256 * 2**20  # the most raw bytes `DeferredEncodings` packs at once (then it packs what waits)


@dataclass(frozen=True, eq=False)
class WaitingKeys:
    """A layer's gate keys [B, n, t, dg] waiting in `DeferredEncodings`: where their codes (and, at 8 bits, scales)
    go, the keys (the gate's projections where `rotation` is given), their width."""

    codes_at: Tensor
    scales_at: Tensor | None
    keys: Tensor
    bits: int
    rotation: GateKeyRotation | None

    def group(self) -> tuple:
        """What the keys rotated and encoded in one call share: width, batch, positions, head size, dtype, and
        rotated or not, by the same cos/sin."""
        rotation = self.rotation
        positions = (id(rotation.cos), id(rotation.sin)) if rotation is not None else None
        return (self.bits, self.keys.shape[0], *self.keys.shape[2:], self.keys.dtype, positions)


class DeferredEncodings:
    """A prompt chunk's cache encodings, every layer's together: the whole blocks it completes in every K and V
    store, packed in one encoding of all that wait (`packed_fields`: about the ops of one layer's pair) once
    `PACK_TOGETHER_BYTES` of raw rows wait and at the end of the forward (`flush`), where `append_pair` packs
    each layer's as the layer runs; and its gate keys, rotated (those handed over as projections, with their
    `GateKeyRotation`) and encoded (`encode_gate_keys`) in one call each per group at `flush`.
    For a dense prefill, whose chunk attends over its own raw K/V and the prefix packed before it and never
    reads its gate keys: the cache then holds what encoding each layer as it runs leaves (bit for bit on the
    CPU; tests/test_prefill_cost.py)."""

    def __init__(self) -> None:
        self.blocks: list[tuple[KVStore, Tensor, int]] = []  # a store, its whole blocks' raw rows, their first token
        self.waiting_keys: list[WaitingKeys] = []
        self.waiting_bytes = 0

    def append_pair(
        self, k_store: KVStore, v_store: KVStore, keys: Tensor, values: Tensor
    ) -> tuple[Tensor | None, Tensor | None]:
        """`append_pair`'s result and stores, the whole blocks' fields written by a later `flush`."""
        joined = []
        for store, states in ((k_store, keys), (v_store, values)):
            raw = store._joined(states)
            if raw is not None:
                whole = store._blocks_completed()
                if whole:
                    blocks = raw[:, :, :whole]
                    self.blocks.append((store, blocks, store._blocks_start()))
                    self.waiting_bytes += blocks.numel() * blocks.element_size()
                store._store_tail(raw, whole)  # at once: a deferred view of its rows would keep the chunk alive
            joined.append(raw)
        if self.waiting_bytes >= PACK_TOGETHER_BYTES:
            self._pack_blocks()
        return joined[0], joined[1]

    def add_gate_keys(
        self,
        codes_at: Tensor,
        scales_at: Tensor | None,
        gate_keys: Tensor,
        bits: int,
        rotation: GateKeyRotation | None = None,
    ) -> None:
        """`encode_gate_keys(gate_keys, bits)` [B, n, t, dg] written into `codes_at` (and `scales_at`, for 8 bits)
        at the next `flush`: the views of a layer's gate-key buffers its `keep_gate_keys` (their one writer)
        hands over. With `rotation` the keys are the gate's projections, rotated at the `flush` first."""
        self.waiting_keys.append(WaitingKeys(codes_at, scales_at, gate_keys, bits, rotation))

    def flush(self) -> None:
        """Write everything that waits: the blocks packed in one encoding where their compressors allow
        (`packed_fields`), and the gate keys of each group (`WaitingKeys.group`, at most `PACK_TOGETHER_BYTES`
        of keys) rotated, where they are projections, and encoded in one call each."""
        self._pack_blocks()
        waiting, self.waiting_keys = self.waiting_keys, []
        runs: list[list[WaitingKeys]] = []
        open_runs: dict[tuple, tuple[list[WaitingKeys], int]] = {}  # each group's last run and its bytes
        for entry in waiting:
            size = entry.keys.numel() * entry.keys.element_size()
            run, held = open_runs.get(entry.group(), ([], 0))
            if not run or held + size > PACK_TOGETHER_BYTES:
                run, held = [], 0
                runs.append(run)
            run.append(entry)
            open_runs[entry.group()] = (run, held + size)
        writes = []
        for run in runs:
            keys, sizes = [entry.keys for entry in run], [entry.keys.shape[1] for entry in run]
            rotations = [entry.rotation for entry in run]
            joined = GateKeyRotation.apply_joined(rotations, keys) if rotations[0] is not None else torch.cat(keys, 1)
            codes, scales = encode_gate_keys(joined, run[0].bits)
            scale_parts = scales.split(sizes, 1) if scales is not None else [None] * len(run)
            for entry, code_part, scale_part in zip(run, codes.split(sizes, 1), scale_parts, strict=True):
                writes.append((entry.codes_at, code_part))
                if entry.scales_at is not None:
                    writes.append((entry.scales_at, scale_part))
        write_all(writes)

    def _pack_blocks(self) -> None:
        pending, self.blocks, self.waiting_bytes = self.blocks, [], 0
        if not pending:
            return
        fields = packed_fields([store.compressor for store, _, _ in pending], [raw for _, raw, _ in pending])
        write_all(
            [
                pair
                for (store, _, start), packed in zip(pending, fields, strict=True)
                for pair in store._field_writes(packed, start)
            ]
        )

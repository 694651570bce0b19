"""ASQ KV compressor: adaptive-cluster prototypes plus low-bit per-token residuals.

Tokens are compressed causally in blocks of ``block_size`` along the sequence axis. For each full
block and KV head a small MLP softly assigns every token to one of ``cluster_num`` clusters; the
prototypes are the assignment-weighted means of the block's own tokens. Each token stores its
cluster id (uint8), its residual ``x - prototype[id]`` quantized on the mid-rise grid of 2, 4 or 8
bits with a per-token fp16 scale (`gsm_train.quant`), and the newest, incomplete block is kept
uncompressed.

With ``rotate_residuals`` the block's rows are rotated (``x @ R``, `quant.hadamard_rotation`) before
the prototypes are averaged and the residuals taken: both are of the rotated rows, and a reader adds
them in that basis and rotates the sum back once (``x_hat = (prototype[id] + residual) @ R.T``). The
assignment MLP reads the rows unrotated.

Prototypes and scales are rounded to fp16 in the fake-quant path as storage rounds them, so eval
``forward(x)`` equals ``decompress(compress(x))``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn
from torch.distributed.fsdp import FSDPModule

from gsm_train.compiled import compiled
from gsm_train.config.schema import KVCompressionConfig
from gsm_train.functional.asq import (
    Encoded,
    PackedKV,
    distortion,
    encode_blocks,
    gather_prototypes,
    paired_reconstruction,
    reconstruction_and_distortion,
    width_runs,
)
from gsm_train.kernels import asq_pack
from gsm_train.quant import (
    EPS,
    STORE_DTYPE,
    asq_bytes,
    check_bits,
    compute_dtype,
    hadamard_rotation,
    hadamard_signs,
    join_blocks,
    pack_codes,
    split_blocks,
    stored_split,
    unpack_codes,
    unrotated,
)

__all__ = ["ASQCompressor", "PackedKV", "packed_together", "paired_training_pass", "stored_pair"]


def _check(ok: bool, name: str, msg: str) -> None:
    """Raise ``ValueError`` naming the offending argument when ``ok`` is false."""
    if not ok:
        raise ValueError(f"{name} {msg}")


def _alike(asq_k: ASQCompressor, asq_v: ASQCompressor) -> bool:
    """Whether two compressors differ at most in their residual bits."""
    fields = ("num_kv_heads", "head_dim", "cluster_num", "hidden_dim", "block_size", "tau", "rotate_residuals")
    return all(getattr(asq_k, name) == getattr(asq_v, name) for name in fields)


def _plain_parameters(module: nn.Module) -> bool:
    """Not an FSDP2 unit or ZeRO-3 partitions: both gather a module's parameters only when it is called."""
    return not isinstance(module, FSDPModule) and not any(hasattr(p, "ds_id") for p in module.parameters())


def paired_training_pass(
    asq_k: ASQCompressor, asq_v: ASQCompressor, key: Tensor, value: Tensor
) -> tuple[Tensor, Tensor, Tensor] | None:
    """K's and V's training passes as one (`paired_reconstruction`, compiled on the GPU): (K's
    reconstruction, V's, the mean of their reconstruction losses), what `asq_k(key, with_loss=True)` and
    `asq_v(value, with_loss=True)` give (fp32 sums in another order); None where the two must run apart:
    outside training, before a first full block, K and V of other shapes or dtypes, compressors that differ
    in more than their bits, or parameters that only the modules' own calls gather. One pass serves
    both, which halves ASQ's kernels in a training step (docs/design-decisions.md)."""
    if not (
        isinstance(asq_k, ASQCompressor)
        and isinstance(asq_v, ASQCompressor)
        and asq_k.training
        and asq_v.training
        and key.shape == value.shape
        and key.dtype == value.dtype
        and key.shape[2] >= asq_k.block_size
        and _alike(asq_k, asq_v)
        and _plain_parameters(asq_k)
        and _plain_parameters(asq_v)
    ):
        return None
    asq_k._check_input(key)
    asq_v._check_input(value)
    heads = key.shape[1]
    training_pass = compiled(paired_reconstruction) if key.is_cuda else paired_reconstruction
    with torch.autocast(device_type=key.device.type, enabled=False):
        return training_pass(
            key,
            value,
            (asq_k._mlp(heads), asq_v._mlp(heads)),
            asq_k.tau,
            (asq_k.quant_bits, asq_v.quant_bits),
            asq_k.rotation,
            asq_k.block_size,
        )


def stored_pair(asq_k: nn.Module, asq_v: nn.Module, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor] | None:
    """Key and value [B, H, S, D] as a generation cache stores and reads them back (`ASQCompressor.as_stored`
    of `packed_together`'s fields, the pack `kv_store.append_pair` makes): what an eval-mode pass attends
    over, so that teacher forcing reads the rows the cached steps read, bit for bit. None where
    `packed_together` does not take the pair (then each compressor's own forward serves), no block is whole,
    or gradients would flow to key or value (the pack passes none)."""
    if not isinstance(asq_k, ASQCompressor) or torch.is_grad_enabled() and (key.requires_grad or value.requires_grad):
        return None
    whole = key.shape[2] - key.shape[2] % asq_k.block_size
    fields = packed_together([asq_k, asq_v], [key[:, :, :whole], value[:, :, :whole]]) if whole else None
    if fields is None:
        return None
    return asq_k.as_stored(key, fields[0]), asq_v.as_stored(value, fields[1])


def packed_together(compressors: list[nn.Module], rows: list[Tensor]) -> list[dict[str, Tensor]] | None:
    """Each compressor's `pack_blocks` fields of its whole blocks `rows[i]` [B, H, n * block_size, D], from one
    encoding of all of them, their heads side by side (one soft assignment, one set of prototypes, and one
    quantization and one code packing per bit width: the rows are encoded ordered by width): what
    `compressors[i].pack_blocks(rows[i])` gives, every op per head and block as theirs (bit for bit:
    tests/test_prefill_cost.py on the CPU and a GPU, where both take the packing kernel). None
    where they must pack apart: compressors that are not ASQ or differ in more than their bits, rows of other
    shapes or dtypes, or parameters that only the modules' own calls gather."""
    first, shape, dtype = compressors[0], rows[0].shape, rows[0].dtype
    if not (
        all(isinstance(c, ASQCompressor) and _alike(first, c) and _plain_parameters(c) for c in compressors)
        and all(r.shape == shape and r.dtype == dtype for r in rows)
    ):
        return None
    for compressor, part in zip(compressors, rows, strict=True):
        _check(part.shape[-2] % compressor.block_size == 0, "x", f"must hold whole blocks of {compressor.block_size}")
        compressor._check_input(part, leading_heads=True)
    order = sorted(range(len(compressors)), key=lambda i: compressors[i].quant_bits)  # each width's heads together
    runs = width_runs(tuple(compressors[i].quant_bits for i in order))
    heads = shape[1]
    joined = torch.cat([rows[i] for i in order], 1)
    mlps = [compressors[i]._mlp(heads) for i in order]
    w1, b1, w2, b2 = (torch.cat(parts, 0) for parts in zip(*mlps, strict=True))
    with torch.no_grad(), torch.autocast(device_type=joined.device.type, enabled=False):
        if asq_pack.kernel_runs(joined, first.block_size, first.cluster_num, first.hidden_dim):
            ids, residuals, scale, prototypes = asq_pack.pack_blocks(
                joined, w1, b1, w2, b2, first.tau, runs, first.rotation, first.block_size
            )
        else:
            ids, residuals, scale, prototypes = _encoded_fields(joined, (w1, b1, w2, b2), first, runs, heads)
    places = [(run, at) for run, (_, count) in enumerate(runs) for at in range(count)]  # each place's run, index
    fields: list[dict[str, Tensor]] = [{} for _ in compressors]
    for place, i in enumerate(order):
        side, (run, at) = slice(place * heads, (place + 1) * heads), places[place]
        residual = residuals[run][:, at * heads : (at + 1) * heads]
        fields[i] = {
            "ids": ids[:, side],
            "residual": residual,
            "scales": scale[:, side],
            "prototypes": prototypes[:, side],
        }
    return fields


def _encoded_fields(
    joined: Tensor, mlp: tuple[Tensor, ...], first: ASQCompressor, runs: list[tuple[int, int]], heads: int
) -> tuple[Tensor, list[Tensor], Tensor, Tensor]:
    """`packed_together`'s encoding in PyTorch (`encode_blocks`): (ids uint8 [B, H', n * bs], the residual
    codes of each run of widths, scales fp16 [B, H', n * bs], prototypes fp16 [B, H', n, C, D]) of whole
    blocks `joined` [B, H', n * bs, D], `heads` heads a group and `runs` (width, groups) in head order."""
    blocks, _ = split_blocks(joined, first.block_size)
    blocks = blocks.to(compute_dtype(blocks))
    widths = tuple(width for width, count in runs for _ in range(count))
    enc = encode_blocks(blocks, *mlp, first.tau, widths, first.rotation)
    b, _, n, bs, d = blocks.shape
    # each field cast once for all; the residual codes packed once per width
    ids = enc.ids.reshape(b, -1, n * bs).to(torch.uint8)
    scale = enc.scale.reshape(b, -1, n * bs).to(STORE_DTYPE)
    prototypes, q = enc.prototypes.to(STORE_DTYPE), enc.q.reshape(b, -1, n * bs, d)
    parts = q.split([count * heads for _, count in runs], 1)
    residuals = [pack_codes(part, width) for part, (width, _) in zip(parts, runs, strict=True)]
    return ids, residuals, scale, prototypes


def _stored_fields(ids: Tensor, q: Tensor, scale: Tensor, prototypes: Tensor, bits: int) -> dict[str, Tensor]:
    """The `pack_blocks` fields, in their stored dtypes, of an encoding's cluster ids [B, H, S], residual
    levels [B, H, S, D], scales [B, H, S] and prototypes [B, H, n, C, D], the levels packed at `bits`."""
    return {
        "ids": ids.to(torch.uint8),
        "residual": pack_codes(q, bits),
        "scales": scale.to(STORE_DTYPE),
        "prototypes": prototypes.to(STORE_DTYPE),
    }


class ASQCompressor(nn.Module):
    """Causal block-wise ASQ compressor for one layer's K or V ([B, H, S, D]).

    ``forward`` returns the fake-quantized reconstruction (straight-through rounding);
    ``compress`` / ``decompress`` give the real packed storage. Detached logging stats
    of the last forward in eval mode are kept in ``last_stats``.
    """

    def __init__(
        self,
        num_kv_heads: int,
        head_dim: int,
        cluster_num: int = 32,
        hidden_dim: int = 64,
        quant_bits: int = 4,
        block_size: int = 128,
        tau: float = 1.0,
        rotate_residuals: bool = False,
    ) -> None:
        super().__init__()
        _check(num_kv_heads >= 1, "num_kv_heads", f"must be >= 1, got {num_kv_heads!r}")
        _check(head_dim >= 1, "head_dim", f"must be >= 1, got {head_dim!r}")
        _check(2 <= cluster_num <= 256, "cluster_num", f"must be in [2, 256], got {cluster_num!r}")
        _check(hidden_dim >= 1, "hidden_dim", f"must be >= 1, got {hidden_dim!r}")
        check_bits(quant_bits)
        _check(block_size >= 1, "block_size", f"must be >= 1, got {block_size!r}")
        _check(tau > 0, "tau", f"must be > 0, got {tau!r}")
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.cluster_num = cluster_num
        self.hidden_dim = hidden_dim
        self.quant_bits = quant_bits
        self.block_size = block_size
        self.tau = tau
        self.rotate_residuals = rotate_residuals
        # rebuilt from head_dim wherever the compressor is built, so not part of its state (or an export's tensors);
        # kept in fp64 whatever the module is cast to (`_apply`), and rounded where it is used
        self.register_buffer("rotation", hadamard_rotation(head_dim) if rotate_residuals else None, persistent=False)
        # its row signs (+-1, exact in any dtype), for the fused decode kernel's Walsh-Hadamard transform
        self.register_buffer(
            "rotation_signs", hadamard_signs(head_dim).float() if rotate_residuals else None, persistent=False
        )
        self.w1 = nn.Parameter(torch.randn(num_kv_heads, head_dim, hidden_dim) / math.sqrt(head_dim))
        self.b1 = nn.Parameter(torch.zeros(num_kv_heads, hidden_dim))
        self.w2 = nn.Parameter(torch.randn(num_kv_heads, hidden_dim, cluster_num) / math.sqrt(hidden_dim))
        self.b2 = nn.Parameter(torch.zeros(num_kv_heads, cluster_num))
        self.last_stats: dict[str, Tensor] = {}

    def _apply(self, fn, recurse: bool = True):  # noqa: ANN001, ANN202 (nn.Module's signature)
        """nn.Module's `_apply` (`.to()`, `.cuda()`, `.half()`, ...), then the rotation rebuilt exactly in
        fp64 on its new device: a cast to bf16 would otherwise round its entries for good."""
        super()._apply(fn, recurse)
        if self.rotation is not None and self.rotation.dtype != torch.float64:
            self.rotation = hadamard_rotation(self.head_dim).to(self.rotation.device)
        return self

    def extra_repr(self) -> str:
        return (
            f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"cluster_num={self.cluster_num}, hidden_dim={self.hidden_dim}, "
            f"quant_bits={self.quant_bits}, block_size={self.block_size}, tau={self.tau}, "
            f"rotate_residuals={self.rotate_residuals}"
        )

    # ---------------------------------------------------------------- internals

    def _check_input(self, x: Tensor, leading_heads: bool = False) -> None:
        """``x`` is [B, H, S, D] with this compressor's H (or, with ``leading_heads``, its first H heads)."""
        _check(x.dim() == 4, "x", f"must be [B, H, S, D], got shape {tuple(x.shape)}")
        heads_ok = 1 <= x.shape[1] <= self.num_kv_heads if leading_heads else x.shape[1] == self.num_kv_heads
        _check(
            heads_ok and x.shape[3] == self.head_dim,
            "x",
            f"must have H={self.num_kv_heads}, D={self.head_dim}, got shape {tuple(x.shape)}",
        )

    def _mlp(self, heads: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The assignment MLP's (w1, b1, w2, b2) for an input of the first `heads` heads (heads are
        independent): the parameters themselves for all heads, whose gradients then need no slice's
        backward (a zero fill and a copy per parameter, eight small kernels per layer in a training step)."""
        params = self.w1, self.b1, self.w2, self.b2
        return params if heads == self.num_kv_heads else tuple(p[:heads] for p in params)

    def _encode(self, blocks: Tensor) -> Encoded:
        """Cluster, build prototypes and quantize residuals of blocks [B, H, n, bs, D] (`compute_dtype`)."""
        return encode_blocks(blocks, *self._mlp(blocks.shape[1]), self.tau, self.quant_bits, self.rotation)

    def _split_input(self, x: Tensor, leading_heads: bool = False) -> tuple[Tensor, Tensor]:
        """Validate ``x``; its full blocks in `compute_dtype` and its tail."""
        self._check_input(x, leading_heads)
        full, tail = split_blocks(x, self.block_size)
        return full.to(compute_dtype(full)), tail

    def _encode_input(self, x: Tensor, leading_heads: bool = False) -> tuple[Encoded | None, Tensor, Tensor]:
        """Validate and split ``x``; returns (encoding or None if no full block, blocks in `compute_dtype`, tail)."""
        blocks, tail = self._split_input(x, leading_heads)
        with torch.autocast(device_type=x.device.type, enabled=False):
            enc = self._encode(blocks) if blocks.shape[2] > 0 else None
        return enc, blocks, tail

    @torch.no_grad()
    def _record_stats(self, ids: Tensor | None, blocks: Tensor, x_hat: Tensor) -> None:
        """`last_stats` of blocks [B, H, n, bs, D] encoded with cluster `ids` [B, H, n, bs] (int64; None: no
        block) and reconstructed as `x_hat` (their shape)."""
        if ids is None:
            nan = torch.tensor(float("nan"), device=blocks.device)
            self.last_stats = {"recon_rel_error": nan, "cluster_usage": nan, "dead_clusters": nan}
            return
        err = (x_hat - blocks).norm() / blocks.norm().clamp_min(EPS)
        used = torch.zeros(*ids.shape[:3], self.cluster_num, dtype=torch.bool, device=blocks.device)
        used.scatter_(-1, ids, True)
        self.last_stats = {
            "recon_rel_error": err.detach(),
            "cluster_usage": used.float().mean(),
            "dead_clusters": (~used).sum(dim=-1).float().mean(),
        }

    # ---------------------------------------------------------------- public API

    def forward(self, x: Tensor, with_loss: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Fake-quantized reconstruction of ``x`` [B, H, S, D]; the trailing partial block is returned as is.
        With ``with_loss``, ``(reconstruction, reconstruction_loss(x))`` from the one encoding (a method of
        its own would bypass FSDP2's and ZeRO-3's parameter gathering, which hook ``forward``). In eval
        mode it also records ``last_stats`` (training steps skip that work). A training pass with
        ``with_loss`` runs `reconstruction_and_distortion`, compiled on the GPU (once per input shape:
        training steps have one; `_to_store` rounds in integer arithmetic that the compiler keeps): its fused
        kernels sum in another order, so a token near a tie may take another cluster or code than the
        eager pass (about 0.01% of the elements on the test's data)."""
        if with_loss and self.training and x.shape[2] >= self.block_size:
            blocks, tail = self._split_input(x)
            training_pass = compiled(reconstruction_and_distortion) if x.is_cuda else reconstruction_and_distortion
            with torch.autocast(device_type=x.device.type, enabled=False):
                x_hat, loss = training_pass(blocks, *self._mlp(x.shape[1]), self.tau, self.quant_bits, self.rotation)
            return join_blocks(x_hat, tail), loss
        enc, blocks, tail = self._encode_input(x)
        x_hat = enc.reconstruct() if enc is not None else blocks
        if not self.training:
            self._record_stats(enc.ids if enc is not None else None, blocks, x_hat)
        out = join_blocks(x_hat, tail) if enc is not None else x
        return (out, distortion(enc, blocks)) if with_loss else out

    def reconstruction_loss(self, x: Tensor) -> Tensor:
        """Clustering loss for the assignment MLP (differentiable, fp32 scalar).

        Soft k-means distortion ``sum_t sum_c p_tc ||x_t - prototype_c||^2`` over full blocks,
        divided by the within-block variance ``sum_t ||x_t - mean_block||^2``. It lies in
        [0, 1] (1 = no better than one prototype per block); it is the residual energy the
        quantizer must encode. Zero when ``x`` has no full block.
        """
        enc, blocks, _ = self._encode_input(x)
        return distortion(enc, blocks)

    @torch.no_grad()
    def compress(self, x: Tensor) -> PackedKV:
        """Pack ``x`` [B, H, S, D] as a cache of S tokens stores it (see :class:`PackedKV`): every
        block but the newest compressed, the newest (1..block_size tokens) kept raw in the tail."""
        self._check_input(x)
        s_full = stored_split(x.shape[2], self.block_size)
        packed = self.compress_blocks(x[:, :, :s_full])
        packed.tail = x[:, :, s_full:].clone()
        return packed

    @torch.no_grad()
    def compress_blocks(self, x: Tensor) -> PackedKV:
        """Pack whole blocks ``x`` [B, H, n * block_size, D] (the tail of the result is empty); ``x`` may
        hold only the first H heads (a bridge target caches only the heads it keeps)."""
        _check(
            x.shape[-2] % self.block_size == 0,
            "x",
            f"must hold whole blocks of {self.block_size} tokens, got {x.shape[-2]}",
        )
        enc, blocks, tail = self._encode_input(x, leading_heads=True)
        return PackedKV(
            **self._stored(enc, blocks),
            tail=tail.clone(),
            bits=self.quant_bits,
            block_size=self.block_size,
            rotation=self.rotation,
        )

    def _stored(self, enc: Encoded | None, blocks: Tensor) -> dict[str, Tensor]:
        """The `pack_blocks` fields of the encoding of blocks [B, H, n, bs, D] (None: no block)."""
        b, h, n, bs, d = blocks.shape
        if enc is None:
            ids = torch.zeros(b, h, 0, dtype=torch.long, device=blocks.device)
            q = blocks.new_zeros(b, h, 0, d)
            scale = blocks.new_zeros(b, h, 0)
            prototypes = blocks.new_zeros(b, h, 0, self.cluster_num, d)
        else:
            ids, q = enc.ids.reshape(b, h, n * bs), enc.q.reshape(b, h, n * bs, d)
            scale, prototypes = enc.scale.reshape(b, h, n * bs), enc.prototypes
        return _stored_fields(ids, q, scale, prototypes, self.quant_bits)

    @staticmethod
    def decompress(packed: PackedKV) -> Tensor:
        """Rebuild [B, H, S, D] (in the tail's dtype) from :class:`PackedKV`."""
        b, h, s_full = packed.ids.shape
        n, d = packed.prototypes.shape[2], packed.head_dim
        ids = packed.ids.long().reshape(b, h, n, packed.block_size)
        dtype = compute_dtype(packed.tail)
        q = unpack_codes(packed.residual, packed.bits, d, dtype).reshape(b, h, n, packed.block_size, d)
        scale = packed.scales.to(dtype).reshape(b, h, n, packed.block_size, 1)
        x_hat = unrotated(gather_prototypes(packed.prototypes.to(dtype), ids) + q * scale, packed.rotation)
        return join_blocks(x_hat, packed.tail)

    # ---------------------------------------------------------------- the compressor interface (kv_registry)

    @classmethod
    def build(
        cls, config: KVCompressionConfig, layer: int, num_kv_heads: int, head_dim: int
    ) -> tuple[ASQCompressor, ASQCompressor]:
        """K's and V's compressors of `layer` as `config` sets them (each side at its own bits)."""
        return tuple(
            cls(
                num_kv_heads,
                head_dim,
                config.cluster_num,
                config.hidden_dim,
                bits,
                config.block_size,
                config.tau,
                config.rotate_residuals,
            )
            for bits in config.bits(layer)
        )

    @staticmethod
    def bytes_per_token(config: KVCompressionConfig, layer: int, seq_len: int, head_dim: int) -> float:
        """Bytes K and V of one KV head of `layer` take per token in a cache of `seq_len` (amortised)."""
        return sum(
            asq_bytes(seq_len, 1, head_dim, config.cluster_num, bits, config.block_size)["bytes_per_token"]
            for bits in config.bits(layer)
        )

    def field_specs(self, batch: int, heads: int, capacity: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The shape and dtype of each `pack_blocks` field for `capacity` tokens (a whole number of blocks) of
        `heads` heads (the cache allocates them, `quant.zeroed_fields`)."""
        nbytes = math.ceil(self.head_dim * self.quant_bits / 8)
        blocks = capacity // self.block_size
        return {
            "ids": ((batch, heads, capacity), torch.uint8),
            "residual": ((batch, heads, capacity, nbytes), torch.uint8),
            "scales": ((batch, heads, capacity), STORE_DTYPE),
            "prototypes": ((batch, heads, blocks, self.cluster_num, self.head_dim), STORE_DTYPE),
        }

    @torch.no_grad()
    def pack_blocks(self, x: Tensor) -> dict[str, Tensor]:
        """Whole blocks x [B, H, n * block_size, D] as the cache stores them: `ids` uint8 [B, H, F], `residual`
        uint8 [B, H, F, ceil(D * bits / 8)], `scales` fp16 [B, H, F], `prototypes` fp16 [B, H, n, C, D]
        (`compress_blocks`' fields, without its empty tail). Where the packing kernel runs (CUDA), it packs them,
        as `packed_together` does: a store packed alone holds what one packed beside another does, bit for bit."""
        _check(x.shape[-2] % self.block_size == 0, "x", f"must hold whole blocks of {self.block_size} tokens")
        kernel = asq_pack.kernel_runs(x, self.block_size, self.cluster_num, self.hidden_dim)
        together = packed_together([self], [x]) if kernel else None
        if together is not None:
            return together[0]
        return self._stored(*self._encode_input(x, leading_heads=True)[:2])

    def as_stored(self, x: Tensor, fields: dict[str, Tensor]) -> Tensor:
        """``x`` [B, H, S, D] as a generation cache reads it back: its whole blocks from their `pack_blocks`
        `fields` (`prefix_rows` in `compute_dtype`, then x's dtype: what `KVStore.packed_prefix` gives), the
        partial last block as is. Records `last_stats` in eval mode."""
        whole = x.shape[2] - x.shape[2] % self.block_size
        rows = self.prefix_rows(fields, whole, compute_dtype(x))
        if not self.training:
            b, h, _, d = x.shape
            blocks = x[:, :, :whole].to(rows.dtype).view(b, h, -1, self.block_size, d)
            ids = fields["ids"].view(b, h, -1, self.block_size).long()
            self._record_stats(ids, blocks, rows.view(blocks.shape))
        return torch.cat((rows.to(x.dtype), x[:, :, whole:]), 2)

    def gather_packed(self, fields: dict[str, Tensor], at: Tensor, dtype: torch.dtype) -> Tensor:
        """Rows [B, H, k, D] in `dtype` at packed positions `at` [B, H, k] of `pack_blocks` fields (joined
        along dim 2): prototype plus residual, rotated back (exact but for `dtype`'s rounding)."""
        ids = torch.gather(fields["ids"], 2, at).long()
        residual = fields["residual"]
        codes = unpack_codes(
            torch.gather(residual, 2, at.unsqueeze(-1).expand(*at.shape, residual.shape[-1])),
            self.quant_bits,
            self.head_dim,
            dtype,
        )
        scales = torch.gather(fields["scales"], 2, at).to(dtype).unsqueeze(-1)
        prototypes = fields["prototypes"]
        b, h, n_blocks, clusters, dim = prototypes.shape
        flat = prototypes.reshape(b, h, n_blocks * clusters, dim)
        index = (at // self.block_size * clusters + ids).unsqueeze(-1).expand(*at.shape, dim)
        return unrotated(torch.gather(flat, 2, index).to(dtype) + codes * scales, self.rotation)

    def prefix_rows(self, fields: dict[str, Tensor], end: int, dtype: torch.dtype) -> Tensor:
        """Rows [B, H, end, D] in `dtype` of packed positions [0, end) (whole blocks) of `pack_blocks` fields:
        `gather_packed` of those positions bit for bit, the fields read by slicing instead of gathering."""
        ids = fields["ids"][:, :, :end].long()
        b, h, _ = ids.shape
        blocks = end // self.block_size
        codes = unpack_codes(fields["residual"][:, :, :end], self.quant_bits, self.head_dim, dtype)
        scales = fields["scales"][:, :, :end].to(dtype).unsqueeze(-1)
        prototypes = gather_prototypes(fields["prototypes"][:, :, :blocks], ids.view(b, h, blocks, self.block_size))
        return unrotated(prototypes.view(b, h, end, self.head_dim).to(dtype) + codes * scales, self.rotation)

    def byte_account(self, seq_len: int, batch_size: int = 1, tail_bytes: int = 2) -> dict[str, float]:
        """:func:`asq_bytes` for this compressor's configuration."""
        return asq_bytes(
            seq_len,
            self.num_kv_heads,
            self.head_dim,
            self.cluster_num,
            self.quant_bits,
            self.block_size,
            batch_size,
            tail_bytes,
        )

"""The GSM modules of one attention layer, and the K/V path they apply in a teacher-forced pass.

`GSMAttentionAdapter` is attached as `self_attn.gsm` (so FSDP wraps it with its decoder layer) and holds
the layer's Sparse Gate Head, ASQ compressors and cache bridge, each optional. It declares its
trainable parts (`gate_parameters`, `compressor_parameters`, `bridge_parameters`): stages choose what
trains from these, never from parameter names.
"""

from __future__ import annotations

from collections.abc import Iterator

from torch import Tensor, nn

from gsm_train.attention.forward_state import ForwardState
from gsm_train.attention.settings import GSMSettings
from gsm_train.modules.cache_bridge import CacheBridge
from gsm_train.modules.errors import GSMError
from gsm_train.modules.kv_compressor import paired_training_pass, stored_pair
from gsm_train.modules.kv_registry import KVCompressor
from gsm_train.modules.sparse_gate import SparseGateHead
from gsm_train.quant import fake_quant_kivi, fake_quant_per_token

KVPair = tuple[Tensor, Tensor]


class GSMAttentionAdapter(nn.Module):
    """The GSM modules of one attention layer; any of gate, K/V compressors and bridge may be None.
    `asq_k` / `asq_v` hold K's and V's compressors of any `kv_compression.method` (named for ASQ, the
    first, since exports name their tensors so)."""

    def __init__(
        self,
        layer_idx: int,
        gate: SparseGateHead | None,
        asq_k: KVCompressor | None,
        asq_v: KVCompressor | None,
        bridge: CacheBridge | None,
        is_bridge_source: bool,
        dense_layer: bool,
    ):
        super().__init__()
        self.layer_idx = layer_idx
        self.gate = gate
        self.asq_k = asq_k
        self.asq_v = asq_v
        self.bridge = bridge
        self.is_bridge_source = is_bridge_source
        self.dense_layer = dense_layer

    def attention_mode(self, settings: GSMSettings) -> str:
        """Main attention of this layer under `settings`: `dense` where it makes no selection (a dense layer,
        which has no gate; a retrieval layer, whose gate is kept but reads every key; sparse attention off),
        else the settings' mode (`sparse` or `oracle` top-k, or `dense`)."""
        sparse = settings.config.sparse_attention
        if self.dense_layer or not sparse.enabled or self.layer_idx in sparse.retrieval_layers:
            return "dense"
        return settings.mode

    def gate_parameters(self) -> Iterator[nn.Parameter]:
        return iter(()) if self.gate is None else self.gate.parameters()

    def compressor_parameters(self) -> Iterator[nn.Parameter]:
        for asq in (self.asq_k, self.asq_v):
            if asq is not None:
                yield from asq.parameters()

    def bridge_parameters(self) -> Iterator[nn.Parameter]:
        return iter(()) if self.bridge is None else self.bridge.parameters()

    def transform_kv(self, key: Tensor, value: Tensor, state: ForwardState) -> tuple[Tensor, Tensor, KVPair | None]:
        """ASQ on this layer's own K/V, then the bridge from the source layer's (compressed) K/V.

        key, value: [B, Hkv, S, D]. Returns (K, V, own): K/V as earlier blocks are stored, and `own`, the
        K/V a query sees in its own (newest, uncompressed) block, or None where they are the same (no
        quantizer upstream). Records the ASQ loss of a training pass into the forward's records.
        """
        key, value, own = self._compressed(key, value, state)
        if self.is_bridge_source:
            state.bridge_source = (key, value, own)
        if self.bridge is None:
            return key, value, own
        if state.bridge_source is None:
            raise GSMError(f"layer {self.layer_idx} is a bridge target but the source layer did not run first")
        src_k, src_v, src_own = state.bridge_source
        mode = state.settings.config.cross_layer_sharing.mode
        if own is not None or src_own is not None:
            own = self.bridge(*(own or (key, value)), *(src_own or (src_k, src_v)), mode)
        key, value = self.bridge(key, value, src_k, src_v, mode)
        return key, value, own

    def _compressed(self, key: Tensor, value: Tensor, state: ForwardState) -> tuple[Tensor, Tensor, KVPair | None]:
        """(K, V) as stored and the raw pair, through ASQ (or the plain baseline the settings name)."""
        if self.asq_k is None:
            return key, value, None
        raw = (key, value)
        baseline = state.settings.kv_baseline
        if baseline is not None:
            bits = (self.asq_k.quant_bits, self.asq_v.quant_bits)
            return (*plain_kv_quant(key, value, baseline, bits, self.asq_k.block_size), raw)
        if not self.training:  # the rows a generation cache reads back, where it packs the pair together
            stored = stored_pair(self.asq_k, self.asq_v, key, value)
            return (*(stored or (self.asq_k(key), self.asq_v(value))), raw)
        paired = paired_training_pass(self.asq_k, self.asq_v, key, value)  # K's and V's in one pass
        if paired is None:
            (key, loss_k), (value, loss_v) = self.asq_k(key, with_loss=True), self.asq_v(value, with_loss=True)
            paired = key, value, (loss_k + loss_v) / 2
        if state.records is not None:
            state.records.add_asq_loss(self.layer_idx, paired[2])
        return paired[0], paired[1], raw


def plain_kv_quant(
    key: Tensor, value: Tensor, kind: str, bits: tuple[int, int], block_size: int
) -> tuple[Tensor, Tensor]:
    """The baselines ASQ must beat, at its (K, V) bits: `per_token` (K and V per token) or `kivi` (K per
    channel over blocks, V per token), newest incomplete block kept as is for `kivi`."""
    key_bits, value_bits = bits
    if kind == "per_token":
        return (
            fake_quant_per_token(key, key_bits).to(key.dtype),
            fake_quant_per_token(value, value_bits).to(value.dtype),
        )
    return (
        fake_quant_kivi(key, key_bits, block_size, per_channel=True).to(key.dtype),
        fake_quant_kivi(value, value_bits, block_size, per_channel=False).to(value.dtype),
    )

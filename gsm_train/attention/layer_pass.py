"""One layer's teacher-forced pass, as the attention dispatcher hands it to its parts."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from gsm_train.attention.adapter import GSMAttentionAdapter
from gsm_train.attention.forward_state import ForwardState


@dataclass
class LayerPass:
    """One layer's teacher-forced pass: query [B, Hq, T, D]; key, value [B, Hkv, S, D] as stored; `own`
    the raw pair a query sees in its own block (None without ASQ); the gate's input; the softmax scale."""

    module: nn.Module
    adapter: GSMAttentionAdapter
    state: ForwardState
    query: Tensor
    key: Tensor
    value: Tensor
    own: tuple[Tensor, Tensor] | None
    inputs: tuple[Tensor, Tensor, Tensor]
    scaling: float
    mode: str

    @property
    def block_size(self) -> int:
        return self.state.settings.config.kv_compression.block_size

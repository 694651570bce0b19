"""Cache bridge: a lower layer's K/V, mapped and normalised, feeds an upper layer's K/V."""

from __future__ import annotations

import torch
from torch import Tensor, nn


class CacheBridge(nn.Module):
    """`alpha * LayerNorm(A(K_src))` (and the same for V) for one target layer.

    `mix` adds it to all of the target's KV heads (no memory saved); `share` replaces the
    target's last `out_heads` KV heads with it, so those heads are never computed or cached.
    """

    def __init__(self, src_kv_heads: int, head_dim: int, out_heads: int, alpha_init: float):
        super().__init__()
        self.out_heads = out_heads
        self.head_dim = head_dim
        width_in, width_out = src_kv_heads * head_dim, out_heads * head_dim
        self.k_map = nn.Linear(width_in, width_out, bias=False)
        self.v_map = nn.Linear(width_in, width_out, bias=False)
        self.k_norm = nn.LayerNorm(head_dim)
        self.v_norm = nn.LayerNorm(head_dim)
        self.alpha = nn.Parameter(torch.full((1,), float(alpha_init)))  # 1-D: FSDP2 cannot shard scalars
        with torch.no_grad():
            eye = torch.eye(width_out, width_in)
            self.k_map.weight.copy_(eye)
            self.v_map.weight.copy_(eye)

    def _map(self, src: Tensor, linear: nn.Linear, norm: nn.LayerNorm) -> Tensor:
        batch, _, length, _ = src.shape
        flat = src.transpose(1, 2).reshape(batch, length, -1)
        mapped = linear(flat.to(linear.weight.dtype)).view(batch, length, self.out_heads, self.head_dim)
        return (self.alpha * norm(mapped)).transpose(1, 2)

    def bridged(self, src_key: Tensor, src_value: Tensor) -> tuple[Tensor, Tensor]:
        """`alpha * LN(A(src))` for K and V: [B, out_heads, S, D] from the source's [B, Hsrc, S, D]."""
        return self._map(src_key, self.k_map, self.k_norm), self._map(src_value, self.v_map, self.v_norm)

    def forward(
        self, key: Tensor, value: Tensor, src_key: Tensor, src_value: Tensor, mode: str
    ) -> tuple[Tensor, Tensor]:
        """The target layer's K/V [B, Hkv, S, D] after bridging from the source K/V."""
        bridged_k, bridged_v = self.bridged(src_key, src_value)
        bridged_k, bridged_v = bridged_k.to(key.dtype), bridged_v.to(value.dtype)
        if mode == "mix":
            return key + bridged_k, value + bridged_v
        if mode == "share":
            keep = key.shape[1] - self.out_heads
            return torch.cat((key[:, :keep], bridged_k), 1), torch.cat((value[:, :keep], bridged_v), 1)
        raise ValueError(f"unknown bridge mode {mode!r}; use mix or share")

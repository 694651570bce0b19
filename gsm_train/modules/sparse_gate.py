"""Sparse Gate Head: a cheap low-dimensional scorer that picks the top-k keys each query needs.

The gate projects the layer's normed hidden states to a gate query and key of `gate_head_dim`
dimensions, rotates them with a subset of the base model's RoPE frequencies (one frequency per
rotated pair, stored in `rope_freq_index`), and scores `q_t . k_j / sqrt(gate_head_dim)`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gsm_train.compiled import compiled
from gsm_train.functional.gate_distill import DistillTarget, gate_kl_from_hidden
from gsm_train.functional.gate_keys import decode_gate_keys, encode_gate_keys, int8_stored_keys
from gsm_train.functional.gate_rope import rope_pair, rope_tables, rotate
from gsm_train.quant import compute_dtype


class SparseGateHead(nn.Module):
    """Gate query/key projections with RoPE; `num_selectors` independent selections per layer."""

    def __init__(
        self, hidden_size: int, gate_head_dim: int, base_head_dim: int, num_selectors: int = 1, key_bits: int = 16
    ):
        super().__init__()
        if gate_head_dim % 2:
            raise ValueError(f"gate_head_dim must be even, got {gate_head_dim}")
        if key_bits not in (8, 16):
            raise ValueError(f"key_bits must be 8 or 16, got {key_bits}")
        self.gate_head_dim = gate_head_dim
        self.num_selectors = num_selectors
        self.key_bits = key_bits
        self.q_proj = nn.Linear(hidden_size, num_selectors * gate_head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_selectors * gate_head_dim, bias=False)
        pairs = gate_head_dim // 2
        base_pairs = base_head_dim // 2
        default_index = torch.arange(pairs) % base_pairs
        self.register_buffer("rope_freq_index", default_index.repeat(num_selectors, 1), persistent=True)

    def forward(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, distill: DistillTarget | None = None
    ) -> tuple[Tensor, Tensor]:
        """Gate queries and keys [B, n, T, gate_head_dim] from hidden [B, T, d] and the model's cos/sin.

        With `distill`, instead the stage-1 KL sum and the rows counted for its sampled queries, computed
        without materialising the gate's queries and keys (`gate_distill.py`). Either way it runs through
        the module's call, where FSDP2 gathers the weights and later reduces their gradients."""
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.q_proj.weight.dtype)
        if distill is not None:
            return gate_kl_from_hidden(
                self.q_proj.weight, self.k_proj.weight, self.rope_freq_index, hidden, cos, sin, distill
            )
        batch, length, _ = hidden.shape
        shape = (batch, length, self.num_selectors, self.gate_head_dim)
        q = self.q_proj(hidden).view(shape).transpose(1, 2)
        k = self.k_proj(hidden).view(shape).transpose(1, 2)
        rope = compiled(rope_pair) if q.is_cuda and q.requires_grad else rope_pair  # training shapes are fixed
        return rope(q, k, cos, sin, self.rope_freq_index)

    def keys(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The gate keys alone [B, n, T, gate_head_dim], the same values `forward` gives (for a cache filled
        without selecting: a dense prefill stores them for later token steps)."""
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.k_proj.weight.dtype)
        batch, length, _ = hidden.shape
        k = self.k_proj(hidden).view(batch, length, self.num_selectors, self.gate_head_dim).transpose(1, 2)
        c, s = rope_tables(cos, sin, self.rope_freq_index, k.dtype)
        return rotate(k, c, s)

    def stored_keys(self, gate_k: Tensor) -> Tensor:
        """fp32 gate keys as the cache holds them (`key_bits`), for selection: teacher-forced and cached
        selections then agree. Round once per layer and score query chunks with `score_stored`. (The
        gate's KL loss scores the unrounded keys.) At 8 bits a training step on the GPU rounds them in one
        compiled kernel instead of a dozen small ones per layer."""
        if self.key_bits == 16:
            return decode_gate_keys(*encode_gate_keys(gate_k.detach(), self.key_bits))
        as_stored = compiled(int8_stored_keys) if gate_k.is_cuda and self.training else int8_stored_keys
        return as_stored(gate_k.detach())

    def score_stored(self, gate_q: Tensor, keys: Tensor) -> Tensor:
        """Gate logits [B, n, T, S] (fp32 products, fp64 for an fp64 query; under autocast its dtype's) over keys
        already decoded from the cache. The 1/sqrt(gate_head_dim) scale goes on the queries, not on the T x S
        logits (one pass over them fewer): where sqrt(gate_head_dim) is a power of two (16, 64, 256) the logits
        are the same bits as scaling them; for other sizes they may differ in the last bit (the fused decode
        kernel's scores are computed another way again)."""
        dtype = compute_dtype(gate_q)
        return torch.matmul(gate_q.to(dtype) * self.gate_head_dim**-0.5, keys.to(dtype).transpose(-1, -2))

    @torch.no_grad()
    def init_from_attention(
        self, q_weight: Tensor, k_weight: Tensor, num_heads: int, num_kv_heads: int, head_dim: int
    ) -> None:
        """Initialise from the layer's q/k projections so that step 0 already selects well.

        RoPE rotates each pair (i, i + head_dim/2) of a head as one complex number by angle
        theta_i * position. For frequency i the head-averaged logit is x^T M_i y with the complex
        matrix M_i = sum_h a_{h,i} b_{g(h),i}^H (a, b: complex rows of q/k). Its best rank-1
        approximation sigma u v^H gives a gate pair that commutes with RoPE exactly. Each selector
        keeps the `gate_head_dim/2` frequencies with the largest sigma (the selector of KV group g
        averages only that group's heads).
        """
        hidden = q_weight.shape[1]
        q = q_weight.double().view(num_heads, head_dim, hidden)
        k = k_weight.double().view(num_kv_heads, head_dim, hidden)
        half = head_dim // 2
        q_c = torch.complex(q[:, :half], q[:, half:])  # [Hq, half, d]
        k_c = torch.complex(k[:, :half], k[:, half:])  # [Hkv, half, d]
        k_per_head = k_c.repeat_interleave(num_heads // num_kv_heads, dim=0)
        heads_per_selector = num_heads // self.num_selectors
        pairs = self.gate_head_dim // 2
        scale = math.sqrt(self.gate_head_dim) / (heads_per_selector * math.sqrt(head_dim))
        q_rows, k_rows, indices = [], [], []
        for sel in range(self.num_selectors):
            heads = slice(sel * heads_per_selector, (sel + 1) * heads_per_selector)
            # M_i = A_i B_i^H with A_i, B_i [d, heads] (one column per head): rank <= heads, so its SVD
            # comes from QR factors and a heads x heads SVD instead of a d x d one.
            a = q_c[heads].permute(1, 2, 0) * scale  # [half, d, heads]
            b = k_per_head[heads].permute(1, 2, 0)
            qa, ra = torch.linalg.qr(a)
            qb, rb = torch.linalg.qr(b)
            u_small, s, vh_small = torch.linalg.svd(ra @ rb.conj().transpose(-1, -2))
            u = qa @ u_small
            v = qb @ vh_small.conj().transpose(-1, -2)
            top = torch.argsort(s[:, 0], descending=True)[:pairs]
            top = top if len(top) == pairs else torch.arange(pairs) % half
            repeats = torch.bincount(top, minlength=half)[top]  # a frequency used twice shares its weight
            root = (s[top, 0] / repeats).sqrt()[:, None]
            gate_q = u[top, :, 0] * root  # zq = u^T x
            gate_k = v[top, :, 0] * root  # zk = v^T y, so zq * conj(zk) = x^T u v^H y
            q_rows.append(torch.cat((gate_q.real, gate_q.imag)))
            k_rows.append(torch.cat((gate_k.real, gate_k.imag)))
            indices.append(top)
        self.q_proj.weight.copy_(torch.cat(q_rows).to(self.q_proj.weight.dtype))
        self.k_proj.weight.copy_(torch.cat(k_rows).to(self.k_proj.weight.dtype))
        self.rope_freq_index.copy_(torch.stack(indices))

"""Sparse Gate Head: a cheap low-dimensional scorer that picks the top-k keys each query needs.

The gate projects the layer's normed hidden states to a gate query and key of `gate_head_dim`
dimensions, rotates them with a subset of the base model's RoPE frequencies (one frequency per
rotated pair, stored in `rope_freq_index`; with `rotated_pairs` r only r pairs are rotated, the others
hold `gate_rope.unrotated_index` and score content alone), and scores `q_t . k_j / sqrt(gate_head_dim)`.
With `query_heads` H > 1 (DSA's lightning indexer) it projects H gate queries per token and H weights, and
scores `sum_h w_h(t) * relu(q_h(t) . k(j) / sqrt(gate_head_dim))` over the same one key per token
(`functional/gate_scores.py`), so the cache holds what it held with one head.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from gsm_train.compiled import compiled
from gsm_train.functional.attention_targets import gate_distill_loss
from gsm_train.functional.gate_distill import DistillTarget, gate_kl_from_hidden
from gsm_train.functional.gate_keys import decode_gate_keys, encode_gate_keys, int8_stored_keys
from gsm_train.functional.gate_rope import GateKeyRotation, rope_pair, rope_tables, rotate, unrotated_index
from gsm_train.functional.gate_scores import gate_logits, pack_queries
from gsm_train.quant import compute_dtype

INIT_QUERY_NOISE = 0.01  # qk_svd init with several query heads: noise std per query row, relative to its rms


class SparseGateHead(nn.Module):
    """Gate query/key projections with RoPE; `num_selectors` independent selections per layer, each with
    `query_heads` query heads over one key (module docstring). With one query head the module holds
    `q_proj`, `k_proj` and `rope_freq_index`; with H > 1 `q_proj` has H times the rows (selector, then
    head, then dimension) and `weights_proj` (with bias) gives each query's H weights. `rotated_pairs`
    (None: all gate_head_dim / 2) pairs of each selector keep a RoPE frequency, the others are not rotated."""

    def __init__(
        self,
        hidden_size: int,
        gate_head_dim: int,
        base_head_dim: int,
        num_selectors: int = 1,
        key_bits: int = 16,
        query_heads: int = 1,
        rotated_pairs: int | None = None,
    ):
        super().__init__()
        if gate_head_dim % 2:
            raise ValueError(f"gate_head_dim must be even, got {gate_head_dim}")
        if key_bits not in (8, 16):
            raise ValueError(f"key_bits must be 8 or 16, got {key_bits}")
        if query_heads < 1:
            raise ValueError(f"query_heads must be at least 1, got {query_heads}")
        pairs = gate_head_dim // 2
        if rotated_pairs is not None and not 0 <= rotated_pairs <= pairs:
            raise ValueError(f"rotated_pairs must be between 0 and gate_head_dim / 2 = {pairs}, got {rotated_pairs}")
        self.gate_head_dim = gate_head_dim
        self.num_selectors = num_selectors
        self.key_bits = key_bits
        self.query_heads = query_heads
        self.rotated_pairs = pairs if rotated_pairs is None else rotated_pairs
        self.unrotated = unrotated_index(base_head_dim)
        self.q_proj = nn.Linear(hidden_size, num_selectors * query_heads * gate_head_dim, bias=False)
        self.k_proj = nn.Linear(hidden_size, num_selectors * gate_head_dim, bias=False)
        self.weights_proj = nn.Linear(hidden_size, num_selectors * query_heads) if query_heads > 1 else None
        default_index = self._unrotate(torch.arange(pairs) % (base_head_dim // 2))
        self.register_buffer("rope_freq_index", default_index.repeat(num_selectors, 1), persistent=True)

    def _unrotate(self, index: Tensor) -> Tensor:
        """`index` [..., dg/2] with the pairs past the first `rotated_pairs` marked unrotated."""
        return index.masked_fill(
            torch.arange(index.shape[-1], device=index.device) >= self.rotated_pairs, self.unrotated
        )

    def forward(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, distill: DistillTarget | None = None
    ) -> tuple[Tensor, Tensor]:
        """Gate queries [B, n, T, Q] and keys [B, n, T, gate_head_dim] from hidden [B, T, d] and the model's
        cos/sin: Q = gate_head_dim with one query head, else the query rows of `gate_scores.pack_queries`.

        With `distill`, instead the stage-1 KL sum and the rows counted for its sampled queries: with one
        query head without materialising the gate's queries and keys (`gate_distill.py`), with several
        through `gate_distill_loss` and autograd. Either way it runs through the module's call, where FSDP2
        gathers the weights and later reduces their gradients."""
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.q_proj.weight.dtype)
        if distill is not None and self.query_heads == 1:
            return gate_kl_from_hidden(
                self.q_proj.weight, self.k_proj.weight, self.rope_freq_index, hidden, cos, sin, distill
            )
        if distill is not None:
            return self._distill_by_autograd(hidden, cos, sin, distill)
        if self.query_heads > 1:
            return self._queries(hidden, cos, sin), self.keys(hidden, cos, sin)
        batch, length, _ = hidden.shape
        shape = (batch, length, self.num_selectors, self.gate_head_dim)
        q = self.q_proj(hidden).view(shape).transpose(1, 2)
        k = self.k_proj(hidden).view(shape).transpose(1, 2)
        training = self.training and q.is_cuda and q.requires_grad  # training shapes are fixed: compiled once
        rope = compiled(rope_pair) if training else rope_pair
        return rope(q, k, cos, sin, self.rope_freq_index)

    def _queries(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """Query rows [B, n, T, H * dg + H] with several query heads: each head rotated by its selector's
        RoPE pairs (the same for every head), then the heads' weights."""
        batch, length, _ = hidden.shape
        heads, selectors, dim = self.query_heads, self.num_selectors, self.gate_head_dim
        q = self.q_proj(hidden).view(batch, length, selectors, heads, dim).permute(0, 2, 1, 3, 4)
        c, s = rope_tables(cos, sin, self.rope_freq_index, q.dtype)
        q = rotate(q, c[..., None, :], s[..., None, :])
        weights = self.weights_proj(hidden).view(batch, length, selectors, heads).transpose(1, 2)
        return pack_queries(q, weights)

    def _distill_by_autograd(
        self, hidden: Tensor, cos: Tensor, sin: Tensor, distill: DistillTarget
    ) -> tuple[Tensor, Tensor]:
        """Stage 1's KL sum and rows counted (as the fused path of one query head gives) for several query
        heads: queries of the sampled rows only, every key, `gate_distill_loss` in one chunk, and autograd
        back to the projections."""
        index = distill.index
        queries = self._queries(hidden[:, index], cos[:, index], sin[:, index])
        return gate_distill_loss(
            distill.query,
            distill.key,
            queries,
            self.keys(hidden, cos, sin),
            distill.allowed_rows,
            distill.counted_rows,
            distill.scaling,
            len(index),
            torch.full((len(index),), distill.key.shape[2]),  # rows drawn on the device: the mask bounds each
        )

    def keys(self, hidden: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        """The gate keys alone [B, n, T, gate_head_dim], the same values `forward` gives (for a cache filled
        without selecting: a dense prefill stores them for later token steps)."""
        return self.key_rotation(cos, sin).apply(self.projected_keys(hidden))

    def projected_keys(self, hidden: Tensor) -> Tensor:
        """The gate keys [B, n, T, gate_head_dim] of hidden [B, T, d] before their RoPE (`key_rotation`)."""
        if not torch.is_autocast_enabled(hidden.device.type):
            hidden = hidden.to(self.k_proj.weight.dtype)
        batch, length, _ = hidden.shape
        return self.k_proj(hidden).view(batch, length, self.num_selectors, self.gate_head_dim).transpose(1, 2)

    def key_rotation(self, cos: Tensor, sin: Tensor) -> GateKeyRotation:
        """The RoPE `projected_keys` of positions with the model's cos/sin [B, T, head_dim] still need."""
        return GateKeyRotation(cos, sin, self.rope_freq_index)

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
        already decoded from the cache: `gate_scores.gate_logits`, for any number of query heads. The
        1/sqrt(gate_head_dim) scale goes on the queries, not on the T x S logits (one pass over them fewer):
        where sqrt(gate_head_dim) is a power of two (16, 64, 256) the logits are the same bits as scaling
        them; for other sizes they may differ in the last bit (the fused decode kernel's scores are computed
        another way again)."""
        dtype = compute_dtype(gate_q)
        return gate_logits(gate_q.to(dtype), keys.to(dtype))

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
        averages only that group's heads); with `rotated_pairs` r only the r of largest sigma stay
        rotated, the others keep their u, v but are not rotated.
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
        self.k_proj.weight.copy_(torch.cat(k_rows).to(self.k_proj.weight.dtype))
        self.rope_freq_index.copy_(self._unrotate(torch.stack(indices)))
        if self.query_heads == 1:
            self.q_proj.weight.copy_(torch.cat(q_rows).to(self.q_proj.weight.dtype))
        else:
            self._init_query_heads(torch.stack(q_rows))

    def _init_query_heads(self, svd_queries: Tensor) -> None:
        """Several query heads from each selector's rank-one query u [n, dg, d]: heads in pairs (u, -u)
        with weights (+1/P, -1/P) for P pairs, since relu(x) - relu(-x) = x makes each pair score u's logit,
        so step 0 scores as the one-head gate does; an odd last head copies u with weight 0. Each head gets
        `INIT_QUERY_NOISE` of its rms as noise, or copies of one pair would stay copies (equal gradients).
        The weights start constant (`weights_proj`: zero matrix, the weights in its bias)."""
        heads, pairs = self.query_heads, self.query_heads // 2
        signs = torch.tensor([(-1.0) ** head for head in range(heads)], dtype=svd_queries.dtype)
        queries = svd_queries[:, None] * signs[None, :, None, None]  # [n, H, dg, d]
        rms = queries.pow(2).mean(-1, keepdim=True).sqrt()
        queries = queries + INIT_QUERY_NOISE * rms * torch.randn_like(queries)
        weights = signs / pairs
        if heads % 2:
            weights[-1] = 0.0
        self.q_proj.weight.copy_(queries.reshape(-1, queries.shape[-1]).to(self.q_proj.weight.dtype))
        self.weights_proj.weight.zero_()
        self.weights_proj.bias.copy_(weights.repeat(self.num_selectors).to(self.weights_proj.bias.dtype))

"""The whole model's forward of one new token per row over a GSM cache, captured once in a CUDA graph
and replayed every step: no Python per layer, no kernel launched one by one.

A captured step is valid for every later step of the same cache because nothing in it depends on a
host value that changes: the kernels read how many tokens the cache holds from the device
(`CacheLengths.device`, advanced by the step itself), the buffers have the cache's capacity, and the
token's ids and RoPE positions are copied into static inputs before each replay. Packing a full block
(every `block_size` steps) is a graph of its own (`CapturedPack`: every layer's pack of one block, the
block read from the device lengths), replayed before the step that needs it. Around the replays runs
only the host's copy of the lengths. The top-k size is baked in, so a step is captured per size
(`StepGraphs`; a schedule whose k varies reads its k on the device within a size).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import Tensor, nn

from gsm_train.attention.settings import GSMSettings, gsm_settings
from gsm_train.compiled import captured
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.decode_attention import captured_k, fused_scores, ranks_picks, static_k
from gsm_train.inference.decode_fusion import fused_decode
from gsm_train.modules.errors import GSMError

# `StepGraphs`' key of dense mode's one captured step: it reads every key held (from the device lengths)
# whatever the schedule's k, so it serves every length, where a sparse step is keyed by its k (`captured_k`)
DENSE_MODE_STEP = 0


def graphs_supported(model: nn.Module, cache: GSMCache) -> str | None:
    """Why this model's token steps cannot be captured (None: they can): they need CUDA, the fused kernels,
    no bridge target (its rows are gathered with host lengths) and, in sparse mode, gates the score kernel
    takes (`fused_scores`)."""
    if cache.kernels is None:
        return "the fused decode kernels do not run here (CUDA and Triton are needed)"
    if not torch.cuda.is_available() or next(model.parameters()).device.type != "cuda":
        return "the model is not on a CUDA device"
    settings = gsm_settings(model)
    if settings.config.cross_layer_sharing.enabled:
        return "a cache bridge's targets gather their rows with host lengths"
    return gate_scored_on_the_host(settings)


def gate_scored_on_the_host(settings: GSMSettings) -> str | None:
    """Why a sparse-mode token step is not captured for the gate (None: it may be): a gate the score kernel
    does not take (several query heads, or a size the kernels do not fit) is scored by `score_stored`
    over the keys the host length counts, which a replay would keep at the captured step's."""
    sparse = settings.config.sparse_attention
    if settings.mode == "sparse" and sparse.enabled and not fused_scores(sparse.gate_head_dim, sparse.gate_query_heads):
        return (
            f"the gate (gate_query_heads={sparse.gate_query_heads}, gate_head_dim={sparse.gate_head_dim}) is "
            "scored on the PyTorch path, which reads host lengths"
        )
    return None


class _WeakCache:
    """`cache`, held weakly: a cache keeps its captured steps (`cache.step_graphs`), so a strong reference back
    would make a cycle that keeps a finished generation's cache, device buffers and all, allocated until
    Python's cycle collector runs. `cache` hands out the cache itself (transformers' forward takes it)."""

    def __init__(self, cache: GSMCache) -> None:
        self._cache = weakref.ref(cache)

    @property
    def cache(self) -> GSMCache:
        cache = self._cache()
        if cache is None:
            raise GSMError("the GSM cache these captured steps were made for no longer exists")
        return cache


class CapturedStep(_WeakCache):
    """One token step of `model` over `cache` for `batch` rows, captured in a CUDA graph (see the module
    docstring). Call it with the new tokens' ids and positions [B, 1]; returns the logits [B, 1, V] (a
    buffer the next replay overwrites). `fused`: warm-up and capture run inside `fused_decode`, so the
    graph holds its kernels. `pack()` packs a full newest block before each replay (default: eagerly,
    `GSMCache.pack_full_tail`; `StepGraphs` passes its `CapturedPack`)."""

    def __init__(
        self, model: nn.Module, cache: GSMCache, batch: int, fused: bool = False, pack: Callable[[], bool] | None = None
    ) -> None:
        super().__init__(cache)
        self.model = model
        self.captured_held = cache.lengths.seq_len  # tokens held when captured (`StepGraphs` reads it)
        device = next(model.parameters()).device
        self.input_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.position_ids = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self._pack = pack
        self.pack()  # a full newest block is packed first, never inside the step's capture
        saved = cache.lengths.snapshot()
        with fused_decode(model, fused):
            self.graph, self.logits = captured(self._forward, lambda: self._restore(saved))

    def pack(self) -> bool:
        """Pack a full newest block (the `pack` given, else `GSMCache.pack_full_tail`); whether there was one."""
        return self._pack() if self._pack is not None else self.cache.pack_full_tail()

    def _forward(self) -> Tensor:
        with torch.no_grad():
            out = self.model.gsm_base_forward(
                input_ids=self.input_ids,
                position_ids=self.position_ids,
                use_cache=True,
                logits_to_keep=1,
                **cache_kwargs(self.model, self.cache),
            )
        return out.logits

    def _restore(self, saved: tuple[int, int, int, Tensor]) -> None:
        """The cache as before a warm-up or the capture: its lengths, and no forward in progress."""
        self.cache.lengths.restore(saved)
        self.cache.end_forward()

    def __call__(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        if self.cache.lengths.seq_len >= self.cache.capacity:
            raise GSMError(
                f"the GSM cache holds {self.cache.capacity} tokens per row and is full; create it "
                "with a larger capacity, or generate fewer tokens"
            )
        self.pack()  # every block_size steps: the graph writes into the tail
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.graph.replay()
        self.cache.lengths.follow_replayed_token()  # the replay advanced the device copy
        return self.logits


class StepGraphs(_WeakCache):
    """The captured token steps of one cache, by the top-k size they are built for (`captured_k`: a
    constant schedule captures once, one whose k varies once per `K_STEP` of its k; dense mode once,
    `DENSE_MODE_STEP`) and whether they rank their picks (`ranks_picks`: a varying k at its ceiling takes a
    step that does not); `fused`: captured with `fused_decode`. Their full blocks are packed by one
    `CapturedPack`, captured at the first."""

    def __init__(self, model: nn.Module, cache: GSMCache, fused: bool = False) -> None:
        super().__init__(cache)
        self.model, self.fused = model, fused
        self.steps: dict[tuple[int, bool], CapturedStep] = {}
        self.captured_pack: CapturedPack | None = None

    def pack(self) -> bool:
        """Pack every layer's full newest block, from the captured pack (captured here at the first full
        block); whether there was one."""
        if self.captured_pack is None:
            if not self.cache.tail_full():
                return False
            self.captured_pack = CapturedPack(self.cache)
        return self.captured_pack()

    def __call__(self, input_ids: Tensor, position_ids: Tensor) -> Tensor:
        settings, held = gsm_settings(self.model), self.cache.lengths.seq_len
        config = settings.config
        sparse = settings.mode != "dense"
        k = captured_k(config, held) if sparse else DENSE_MODE_STEP
        k_static = static_k(k, config.sparse_attention.most_forced_keys(), self.cache.capacity)
        key = (k, sparse and ranks_picks(config, held, k_static))
        step = self.steps.get(key)
        # a cache only grows within a sequence, and a step serves every length from its capture's on: the rule
        # is asked only after a reset (`GSMCache.reset`) started a shorter sequence
        if step is None or (sparse and held < step.captured_held and not _serves(step.captured_held, held, k_static)):
            step = self.steps[key] = CapturedStep(self.model, self.cache, input_ids.shape[0], self.fused, self.pack)
        return step(input_ids, position_ids)


def _serves(captured_held: int, held: int, k_static: int) -> bool:
    """Whether a step captured when the cache held `captured_held` tokens serves a step after `held`: one
    captured once every one of its `k_static` picks was a held key marks none invalid (`select_keys`), so it
    serves only steps from there on. Within a sequence the cache only grows; a reused cache (`GSMCache.reset`)
    starts again, and a shorter sequence than the one the step was captured in gets a step captured anew."""
    return held + 1 >= k_static or captured_held + 1 < k_static


class CapturedPack(_WeakCache):
    """`GSMCache.pack_newest_block` of `cache` captured in a CUDA graph: every layer's pack of one full block
    (the same kernels as the eager `pack_full_tail`, so the same bytes), where it writes read from the
    device lengths, which it advances. Built when the tail is full (its warm-up packs what the replay will,
    so the fields hold only what an eager pack writes); one replay per full block after that, instead of
    some 87 eager ops a layer."""

    def __init__(self, cache: GSMCache) -> None:
        if not cache.tail_full():
            raise GSMError("a block pack is captured when the cache's newest block is full; it is not")
        super().__init__(cache)
        saved = cache.lengths.snapshot()
        # one warm-up builds the libraries' handles on the side stream (there is no Triton kernel to tune)
        self.graph, _ = captured(cache.pack_newest_block, lambda: cache.lengths.restore(saved), warmups=1)

    def __call__(self) -> bool:
        """Pack the full newest block (replay) and let the host lengths follow; False if it is not full."""
        return self.cache.pack_full_tail(self.graph.replay)

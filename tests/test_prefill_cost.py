"""What GSM's prefill costs beyond the dense model's, in aten ops (on a GPU each is a kernel launch, and a
SmolLM2-sized prefill is bound by issuing them: docs/design-decisions.md, "Prefill: where the time to first token
goes"), and that making it cheaper changed nothing it stores: the storage rounding in eager code is the fp16
cast (two ops) where it was thirteen ops of integer arithmetic, which compiled graphs keep; a later chunk
dequantizes the packed prefix without gathering the raw tail beside it; the raw rows since the last packed
block are joined once, by the store, not again by the cache; a prompt's mask without padding is read on the
host once, not once per chunk."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_prefill import BLOCK, EVERYTHING, TOKENS, _contents, _dense_model_layers, _model, _run

from benchmarks.decode_step_profile import OpCounter
from benchmarks.prefill_profile import count_prefill_ops
from gsm_train import quant
from gsm_train.attention import kv_store
from gsm_train.config.schema import KVCompressionConfig
from gsm_train.functional import gate_keys
from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.inference import dense_engine
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import PREFILL_CHUNKS, enable_gsm_generation
from gsm_train.modules.kv_compressor import ASQCompressor, packed_together
from gsm_train.quant import fp16_grid, fp16_grid_bits

# recipes/joint_long.yaml's compressor on SmolLM2's K (3 KV heads of 64): 2 clusters, 4 bits, rotated, blocks of 64
JOINT_LONG_ASQ = KVCompressionConfig(
    enabled=True, cluster_num=2, hidden_dim=64, quant_bits=4, block_size=64, rotate_residuals=True
)
# aten ops (views aside) of one call, counted before this change -> now
# pack_blocks was 82, then 60 (the two fp16 roundings, of prototypes and scales, took 13 ops each, now 2), now 55
# (the floor of the levels without its straight-through form, the code shifts in one op, no empty tail copied, no
# division of the assignment's logits by a temperature of 1)
PACK_BLOCKS_OPS = 55
# K's and V's packing in one call (K's and V's bits equal: True), was 2 x 55; 66 -> 60 with equal bits (one code
# packing per width); 30 layers' K and V in one call take the ops of one layer's pair
PAIRED_PACK_OPS = {False: 83, True: 60}
INT8_GATE_KEYS_OPS = 11  # was 22: the scale's fp16 rounding took 13 ops, now 2
# the most ops a dense prefill chunk's gate keys take on the tiny model of two gated layers (EVERYTHING) when every
# layer's are rotated and encoded together after the forward: each layer's projection (3) and two writes, the
# rotation (16) and the encoding (11) once; 78 where each layer rotates and encodes its own
GATE_KEYS_TOGETHER_OPS = 37


def _assert_same(
    cache: GSMCache, logits: torch.Tensor, reference_cache: GSMCache, reference_logits: torch.Tensor
) -> None:
    """The two caches hold the same fields bit for bit, and the logits are equal."""
    held, reference = _contents(cache), _contents(reference_cache)
    assert held.keys() == reference.keys()
    assert all(torch.equal(held[name], reference[name]) for name in held)
    assert torch.equal(logits, reference_logits)


def _ops(call: object, *args: object) -> int:
    """Aten ops (views aside) one call runs."""
    with torch.no_grad(), OpCounter(_model({}, "sparse")) as counter:
        call(*args)
    return counter.outside.total()


def test_eager_fp16_rounding_equals_the_integer_form_at_every_tie_and_subnormal() -> None:
    """Every finite fp16 value, every midpoint between neighbours and the fp32 values either side of it,
    subnormals, -0.0 and NaN: the cast and the integer arithmetic give the same values and signs."""
    grid = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.float16).float()
    grid = grid[torch.isfinite(grid)].sort().values
    ties = ((grid[1:].double() + grid[:-1].double()) / 2).float()
    up, down = torch.tensor(float("inf")), torch.tensor(float("-inf"))
    special = torch.tensor([float("nan"), 1e-40, -1e-40, -0.0, 0.0, -1e-8, 65519.0, -65519.996, 2.0**-25])
    x = torch.cat([grid, ties, torch.nextafter(ties, up), torch.nextafter(ties, down), special])
    x = torch.cat([x, torch.randn(100_000) * 10.0 ** torch.randint(-9, 4, (100_000,))])
    x = x[~(x.abs() >= 65520)]  # fp16's range (NaN kept)
    cast, bits = fp16_grid(x), fp16_grid_bits(x)
    assert torch.equal(cast.nan_to_num(7.0), bits.nan_to_num(7.0)) and torch.equal(cast.signbit(), bits.signbit())
    # past fp16's range the two forms part (inf, 65536 and above): eagerly the cast, traced the integer form
    past = torch.tensor([65520.0, 70000.0])
    compiled = torch.compile(fp16_grid, fullgraph=True, backend="eager")
    assert torch.isinf(fp16_grid(past)).all() and torch.equal(compiled(past), fp16_grid_bits(past))
    assert torch.equal(compiled(x).nan_to_num(7.0), bits.nan_to_num(7.0))


@pytest.mark.parametrize("prefill", ["dense", "sparse"])
def test_a_chunked_prefill_stores_and_returns_what_the_integer_rounding_gives(
    prefill: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ASQ (rotated, 4- and 2-bit sides) and int8 gate keys, a prompt in three chunks with edges inside blocks:
    the cache holds bit for bit what it held with every rounding in integer arithmetic (as before), and the
    prompt's and the next tokens' logits are the same."""
    model = _model(EVERYTHING, "sparse")
    cache, logits = _run(model, TOKENS, prefill, (5, 11, 13))
    for module in (quant, gate_keys):  # every fp16 rounding in integer arithmetic, as before
        monkeypatch.setattr(module, "fp16_grid", fp16_grid_bits)
    reference_cache, reference_logits = _run(model, TOKENS, prefill, (5, 11, 13))
    _assert_same(cache, logits, reference_cache, reference_logits)


def test_packing_a_chunks_blocks_and_its_gate_keys_run_fewer_ops() -> None:
    asq_k, asq_v = ASQCompressor.build(JOINT_LONG_ASQ.model_copy(update={"value_quant_bits": 2}), 2, 3, 64)
    rows = torch.randn(1, 3, 4096, 64)
    assert _ops(asq_k.pack_blocks, rows) <= PACK_BLOCKS_OPS
    assert _ops(packed_together, [asq_k, asq_v], [rows, rows]) <= PAIRED_PACK_OPS[False]
    assert _ops(packed_together, [asq_k, asq_k], [rows, rows]) <= PAIRED_PACK_OPS[True]
    assert _ops(packed_together, [asq_k, asq_v] * 30, [rows] * 60) <= PAIRED_PACK_OPS[False]
    assert _ops(encode_gate_keys, torch.randn(1, 1, 4096, 16), 8) <= INT8_GATE_KEYS_OPS


def test_a_later_chunk_reads_the_packed_prefix_as_gather_does_with_fewer_ops() -> None:
    """After a chunked prefill, `packed_prefix(n)` is what `gather` gives for positions [0, n), bit for bit,
    and the prefill's dequantization of earlier chunks and cache updates run no more ops than now."""
    model = _model(EVERYTHING, "sparse")
    cache, _ = _run(model, TOKENS[:, :29], "dense", (5, 11, 13))
    assert cache.lengths.packed_len == 3 * BLOCK
    for layer in cache.layers:
        for store, end in itertools.product((layer.k_store, layer.v_store), (BLOCK, 3 * BLOCK)):
            positions = torch.arange(end).expand(*store.tail.shape[:2], -1)
            assert torch.equal(store.packed_prefix(end), store.gather(positions))
            assert store.packed_prefix(0).shape == (*store.tail.shape[:2], 0, store.tail.shape[3])

    def prefill() -> None:
        fresh = GSMCache(model, capacity=29, prefill="dense")
        for start, stop in ((0, 5), (5, 16), (16, 29)):
            model(TOKENS[:, start:stop], use_cache=True, **cache_kwargs(model, fresh))

    parts = count_prefill_ops(prefill, model)["ops_by_part"]
    # 4 layers x 2 sides x 2 later chunks; counted before -> then -> now: dequantized 480 -> 200 -> 136 (ASQ's
    # fields sliced, not gathered), updates 128 -> 112 -> 104 (no join with an empty tail)
    assert parts["earlier_chunks_dequantized"] <= 136 and parts["cache_update"] <= 104


# host syncs of the engine's prefill below, before -> now: dense 5 -> 1; sparse 20 -> 16 (the rest are its
# selection's reads of k, per sparse layer and chunk)
HOST_SYNCS = {"dense": 1, "sparse": 16}


@pytest.mark.parametrize("prefill", ["dense", "sparse"])
def test_a_prompt_without_padding_is_read_on_the_host_once_not_once_per_chunk(prefill: str) -> None:
    """The engine's chunked prefill of 29 tokens in chunks of 8 with an all-ones mask reads the mask on the
    host once, where each chunk's padding check and transformers' causal-skip check read it (5 reads), and
    the cache and the last logits are those of the same chunks fed with the mask's slices."""
    model = _model(EVERYTHING, "sparse")
    enable_gsm_generation(model, cuda_graphs=False, prefill_chunk=8, prefill=prefill)
    ids, outputs = TOKENS[:, :29], {}

    def chunked() -> None:
        cache = outputs["engine"] = GSMCache(model, capacity=29)
        kwargs = cache_kwargs(model, cache) | {"use_cache": True, "logits_to_keep": 1}
        outputs["engine_logits"] = model(input_ids=ids, attention_mask=torch.ones_like(ids), **kwargs).logits

    assert sum(count_prefill_ops(chunked, model)["host_syncs"].values()) == HOST_SYNCS[prefill]
    cache = GSMCache(model, capacity=29)
    with torch.no_grad():
        for end in (8, 16, 24, 29):
            logits = model.gsm_base_forward(
                input_ids=ids[:, end - 8 if end < 29 else 24 : end],
                attention_mask=torch.ones_like(ids[:, :end]),
                use_cache=True,
                logits_to_keep=1,  # the head over one row, as the engine runs it (five rows: another kernel)
                **cache_kwargs(model, cache),
            ).logits
    held, reference = _contents(outputs["engine"]), _contents(cache)
    assert all(torch.equal(held[name], reference[name]) for name in reference)
    assert torch.equal(outputs["engine_logits"], logits)


def test_a_dense_prefill_runs_a_prompt_up_to_the_dense_engines_chunk_in_one_forward_as_the_dense_model() -> None:
    """The engine's default chunk follows the cache's prefill mode: a dense prefill's is the dense engine's
    (8192), a sparse one's stays 4096. A prompt of 4100 tokens, which went in two forwards (the second reading
    the first's K/V dequantized), now goes in one: the base model's prefill, its logits the dense model's bit
    for bit, where the two forwards' differ from them by ASQ's error. A sparse prefill still goes in two."""
    assert PREFILL_CHUNKS == {"dense": dense_engine.PREFILL_CHUNK, "sparse": 4096}
    model = _model(EVERYTHING, "sparse")
    ids = torch.randint(0, 256, (1, 4100), generator=torch.Generator().manual_seed(1))
    dense_logits, _ = _dense_model_layers(model, ids)
    forwards = []
    hook = model.model.register_forward_pre_hook(lambda module, args: forwards.append(1))  # the decoder stack

    def prefill(**options: object) -> torch.Tensor:
        forwards.clear()
        enable_gsm_generation(model, cuda_graphs=False, **options)
        cache = GSMCache(model, capacity=ids.shape[1])
        with torch.no_grad():
            return model(input_ids=ids, use_cache=True, **cache_kwargs(model, cache)).logits

    try:
        assert torch.equal(prefill(), dense_logits) and len(forwards) == 1
        two = prefill(prefill_chunk=4096)
        assert len(forwards) == 2 and torch.equal(two[:, :4096], dense_logits[:, :4096])
        assert not torch.equal(two[:, 4096:], dense_logits[:, 4096:])
        prefill(prefill="sparse")
        assert len(forwards) == 2
    finally:
        hook.remove()


# the paired packing's equality is checked on the CPU here and on a GPU by the same tests, run on the device
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(
    ("bits", "rotate", "dtype", "heads", "batch", "blocks"),
    [
        ((4, 2), True, torch.bfloat16, 3, 1, 64),
        ((4, 2), True, torch.bfloat16, 3, 2, 5),
        ((4, 4), True, torch.float32, 2, 2, 5),
        ((8, 2), False, torch.float64, 3, 2, 5),
    ],
)
def test_k_and_v_packed_in_one_encoding_store_the_bits_of_two(
    bits: tuple[int, int], rotate: bool, dtype: torch.dtype, heads: int, batch: int, blocks: int, device: str
) -> None:
    """`packed_together` of K and V gives each side's `pack_blocks` fields bit for bit (K and V at their own
    bits, RMS-scaled 2-bit V among them; rotated or not; bf16, fp32 and fp64 rows; all heads or a bridge
    target's first ones; a 4096-token chunk), and compressors that differ in more than their bits pack apart
    (None)."""
    config = JOINT_LONG_ASQ.model_copy(update={"quant_bits": bits[0], "value_quant_bits": bits[1]})
    config = config.model_copy(update={"rotate_residuals": rotate})
    torch.manual_seed(0)
    asq_k, asq_v = (side.to(device) for side in ASQCompressor.build(config, 2, num_kv_heads=3, head_dim=64))
    for parameter in asq_v.parameters():  # V's assignment MLP its own
        parameter.data.normal_()
    key, value = (torch.randn(batch, heads, blocks * 64, 64, device=device).to(dtype) * scale for scale in (3.0, 0.5))
    pair = packed_together([asq_k, asq_v], [key, value])
    for packed, compressor, rows in zip(pair, (asq_k, asq_v), (key, value), strict=True):
        alone = compressor.pack_blocks(rows)
        assert packed.keys() == alone.keys()
        assert all(torch.equal(packed[name], alone[name]) for name in alone)
    other = ASQCompressor.build(config.model_copy(update={"cluster_num": 4}), 2, num_kv_heads=3, head_dim=64)[1]
    assert packed_together([asq_k, other], [key, value]) is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("prefill", ["dense", "sparse"])
def test_a_chunked_prefill_packing_k_and_v_together_stores_and_returns_what_packing_them_apart_does(
    prefill: str, device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every feature on (K at 4 bits, V at 2), a prompt in three chunks with edges inside blocks, then token
    steps: the cache holds what it held when each side packed alone, and the logits are the same (bit for bit
    on the CPU; on a GPU within `_assert_same_here`'s bounds)."""
    model, ids = _model(EVERYTHING, "sparse").to(device), TOKENS.to(device)
    cache, logits = _run(model, ids, prefill, (5, 11, 13))
    monkeypatch.setattr(kv_store, "packed_together", lambda *args: None)  # each store packs alone, as before
    reference_cache, reference_logits = _run(model, ids, prefill, (5, 11, 13))
    _assert_same_here(device, cache, logits, reference_cache, reference_logits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunks", [(29,), (5, 11, 13)], ids=["one_call", "unaligned"])
def test_a_dense_prefill_packing_every_layer_after_the_forward_stores_what_packing_each_layer_does(
    chunks: tuple[int, ...], device: str
) -> None:
    """Every feature on, a dense prefill in one call or in three chunks with edges inside blocks, then token
    steps: with each chunk's blocks packed after its forward, every layer's in one encoding
    (`pack_after_forward`, a GPU's default), the cache holds what packing each layer as it runs stores and
    the logits are the same (bit for bit on the CPU; on a GPU within the paired packing's bounds)."""
    model, ids = _model(EVERYTHING, "sparse").to(device), TOKENS.to(device)
    cache, logits = _run(model, ids, "dense", chunks, pack_after_forward=True)
    reference_cache, reference_logits = _run(model, ids, "dense", chunks, pack_after_forward=False)
    assert cache.packs_after_forward and not reference_cache.packs_after_forward
    _assert_same_here(device, cache, logits, reference_cache, reference_logits)
    if device == "cpu":  # the ops of a prompt: the 4 layers' pairs in one encoding, not 4 (4 x 83 now), and
        # the 2 gated layers' keys rotated and encoded in one call each (`GATE_KEYS_TOGETHER_OPS`), not 2 (2 x 39)

        def prefill_ops(together: bool) -> dict[str, int]:
            def prefill() -> None:
                fresh = GSMCache(model, capacity=29, prefill="dense", pack_after_forward=together)
                model(TOKENS[:, :29], use_cache=True, **cache_kwargs(model, fresh))

            return count_prefill_ops(prefill, model)["ops_by_part"]

        together, apart = prefill_ops(True), prefill_ops(False)
        assert together["asq_pack"] <= PAIRED_PACK_OPS[False] and apart["asq_pack"] >= 3 * together["asq_pack"]
        assert together["gate_keys"] <= GATE_KEYS_TOGETHER_OPS < apart["gate_keys"]
        # the cache's writes: each store's raw tail, then one call for every layer's fields and one for every
        # layer's gate keys (`kv_store.write_all`), where a copy each took 4 a store and 2 a gated layer
        assert together["cache_update"] <= 2 * len(model.model.layers) + 2 < apart["cache_update"]


def test_a_dense_prefill_over_the_byte_cap_packs_and_rotates_in_parts_and_stores_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With `PACK_TOGETHER_BYTES` below one layer's rows and keys, the deferred blocks are packed as they come
    and the gate keys rotated a layer at a time: the cache still holds what packing each layer stores."""
    model, ids = _model(EVERYTHING, "sparse"), TOKENS
    reference_cache, reference_logits = _run(model, ids, "dense", (5, 11, 13), pack_after_forward=False)
    monkeypatch.setattr(kv_store, "PACK_TOGETHER_BYTES", 1)
    cache, logits = _run(model, ids, "dense", (5, 11, 13), pack_after_forward=True)
    _assert_same_here("cpu", cache, logits, reference_cache, reference_logits)


def _assert_same_here(
    device: str, cache: GSMCache, logits: torch.Tensor, reference_cache: GSMCache, reference_logits: torch.Tensor
) -> None:
    """`_assert_same` on the CPU; on a GPU up to the summation order of batched kernels of more heads: at the
    tests' tiny shapes a matmul may sum a few prototypes in another order (fp16 values one step apart, and
    from the next layer on the raw K/V within fp32 rounding), so there every field and the logits agree to
    1e-3 relative, 1e-5 absolute, and at least 99% of the integer codes are equal."""
    if device == "cpu":
        _assert_same(cache, logits, reference_cache, reference_logits)
        return
    held, reference = _contents(cache), _contents(reference_cache)
    assert held.keys() == reference.keys()
    for name, field in held.items():
        if field.is_floating_point():
            torch.testing.assert_close(field, reference[name], rtol=1e-3, atol=1e-5, msg=name)
        else:
            assert (field == reference[name]).float().mean().item() >= 0.99, name
    torch.testing.assert_close(logits, reference_logits, rtol=1e-3, atol=1e-5)


def test_a_caches_stored_fields_are_views_of_one_zeroed_buffer_each_store_and_gate() -> None:
    """`zeroed_fields`: tensors of the shapes and dtypes asked, zero, each from a 64-byte boundary, none
    overlapping another; a cache's first prompt allocates per layer one buffer for both stores' fields and
    raw tails and its gate keys and scales (1 fill, where each store's fields, each tail and the gate took one:
    5, and each field one: 12)."""
    specs = {
        "ids": ((2, 3, 40), torch.uint8),
        "residual": ((2, 3, 40, 33), torch.uint8),
        "scales": ((2, 3, 40), torch.float16),
        "keys": ((1, 3, 7, 16), torch.int8),
        "empty": ((2, 0, 5), torch.float32),
        "prototypes": ((2, 3, 5, 2, 64), torch.float16),
    }
    fields = quant.zeroed_fields(specs, torch.device("cpu"))
    for name, (shape, dtype) in specs.items():
        field = fields[name]
        assert field.shape == shape and field.dtype == dtype and field.is_contiguous() and not field.any()
        assert field.data_ptr() % 64 == 0
    for value, field in enumerate(fields.values(), start=1):
        field.fill_(value)
    assert all(bool((field == value).all()) for value, field in enumerate(fields.values(), start=1))
    model = _model(EVERYTHING, "sparse")

    def prefill() -> None:
        model(TOKENS[:, :8], use_cache=True, **cache_kwargs(model, GSMCache(model, capacity=8)))

    assert count_prefill_ops(prefill, model)["ops_by_part"]["cache_buffers"] == 1  # every layer's, one fill

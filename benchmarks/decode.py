"""Sparse decode against dense decode on the GPU, side by side in one run.

1. One layer's decode attention per step: GSM (gate scores over the cached gate keys, the CUDA top-k,
   then the fused gather + ASQ-dequantize + attend kernel; ASQ and gate keys as recipes/joint.yaml sets
   them, or `--asq-bits` / `--unrotated` in its place) against dense SDPA over a bf16 cache, for SmolLM2
   shapes (9 q heads, 3 KV heads, head_dim 64) and a Llama-8B-shaped layer (32 / 8 / 128), at contexts
   8k / 32k / 128k, batch 1 and 16, k 64 and 2048. Both paths are captured in CUDA graphs (as a
   serving engine runs decode), timed with CUDA events, median of 50 replays, per layer. Each graph runs
   up to 16 layers, each with its own cache, until their dense caches hold 2 GiB: as in a model's decode
   step, one graph launch serves them all and no layer reads its cache from L2 left by the previous replay.
2. End to end on SmolLM2-135M (bf16) with a GSM adapter (an export, or the joint recipe's modules
   freshly initialised): greedy `generate()` with `GSMCache` against the dense base with its default
   cache, same prompts; tokens/s, the KV memory held on the device, and agreement of the generated
   tokens with the teacher-forced GSM model's argmax.

python -m benchmarks.decode --eval-data PATH/wikitext-2/valid.txt [--adapter EXPORT] --result OUT.json
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import graph_ms, write_result
from gsm_train.attention import inject_gsm
from gsm_train.attention.kv_store import CacheLengths, KVStore
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm
from gsm_train.functional.gate_keys import encode_gate_keys
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.decode_attention import static_k
from gsm_train.kernels.decode_topk import unordered_top_k
from gsm_train.kernels.sparse_decode import (
    autotuned_config,
    fused_decode_attention,
    gate_scores,
)
from gsm_train.models.model_zoo import load_model_and_tokenizer
from gsm_train.modules.kv_compressor import ASQCompressor
from gsm_train.plots import plot_decode_speedup

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"smollm2": (9, 3, 64), "llama8b": (32, 8, 128)}
H200_BYTES_PER_S = 4.8e12
MODULE_SEED = 0  # seeds the untrained GSM modules of the end-to-end and agreement parts (no --adapter)


def config_name(config: object) -> str:
    """A configuration of the fused decode kernel as the tables name it: rows per tile x tiles, warps, stages."""
    return f"{config.kwargs['BLOCK_N']}x{config.kwargs['TILES']} w{config.num_warps} s{config.num_stages}"


def filled_stores(asqs: tuple[ASQCompressor, ...], batch: int, length: int) -> tuple[KVStore, ...]:
    """One layer's stores (sharing one `CacheLengths`), one per compressor of `asqs` (the same heads and block
    size), of capacity `length` rounded up to whole blocks, holding `length` random tokens each, packed block
    by block in slices (bounded memory)."""
    first = asqs[0]
    kv_heads, dim, block = first.num_kv_heads, first.head_dim, first.block_size
    device = next(first.parameters()).device
    lengths = CacheLengths(device)
    capacity = -(-length // block) * block
    stores = tuple(KVStore(asq, batch, kv_heads, dim, capacity, torch.bfloat16, device, lengths) for asq in asqs)
    slice_len = max(block, (1 << 24) // (batch * kv_heads * dim) // block * block)
    for start in range(0, length, slice_len):
        end = min(start + slice_len, length)
        lengths.add_chunk(end - start, block)
        for store in stores:
            store.append(torch.randn(batch, kv_heads, end - start, dim, device=device, dtype=torch.bfloat16))
    return stores


def compressors(gsm: GSMConfig, kv_heads: int, dim: int, device: str = "cuda") -> tuple[ASQCompressor, ASQCompressor]:
    """K's and V's ASQ compressors on `device` as `gsm` sets them (the bits of the layers `layer_bits` does
    not name)."""
    asq = gsm.kv_compression
    return tuple(
        ASQCompressor(
            kv_heads,
            dim,
            cluster_num=asq.cluster_num,
            quant_bits=bits,
            block_size=asq.block_size,
            rotate_residuals=asq.rotate_residuals,
        ).to(device)
        for bits in asq.bits()
    )


LAYER_BYTES = 1 << 31  # a step's layers together hold at least this much dense cache (or 16 layers)


def layers_per_graph(cache_bytes: int) -> int:
    """How many layers, each with its own cache, one timed step runs: as in a model's decode step, one
    graph launch serves them all and no layer finds its cache in L2 from the previous replay (their
    dense caches together hold LAYER_BYTES, 40x the H200's L2, or there are 16 of them)."""
    return max(1, min(16, -(-LAYER_BYTES // cache_bytes)))


def per_layer_ms(steps: list[Callable[[], object]]) -> float:
    """ms per layer of one CUDA graph replaying every layer's step once (CUDA events, median of 50 replays)."""
    return graph_ms(lambda: [step() for step in steps]) / len(steps)


def dense_sdpa_ms(query: torch.Tensor, kv_heads: int, length: int, layers: int) -> float:
    """ms per layer of dense SDPA decode over a bf16 cache: the faster of GQA-native SDPA and SDPA over K/V
    repeated to the query heads (whichever backend each picks)."""
    batch, q_heads, _, dim = query.shape
    caches = [
        (
            torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16),
            torch.randn(batch, kv_heads, length, dim, device="cuda", dtype=torch.bfloat16),
        )
        for _ in range(layers)
    ]
    native = per_layer_ms(
        [lambda k=k, v=v: F.scaled_dot_product_attention(query, k, v, enable_gqa=True) for k, v in caches]
    )
    wide = [tuple(t.repeat_interleave(q_heads // kv_heads, dim=1) for t in cache) for cache in caches]
    del caches
    repeated = per_layer_ms([lambda k=k, v=v: F.scaled_dot_product_attention(query, k, v) for k, v in wide])
    return min(native, repeated)


Layer = tuple[KVStore, KVStore, torch.Tensor, torch.Tensor | None]  # K store, V store, gate keys, their scales


def layer_caches(
    gsm: GSMConfig, stores_asq: tuple[ASQCompressor, ASQCompressor], batch: int, length: int, layers: int
) -> list[Layer]:
    """`layers` layers' caches of `length` random tokens: K and V stores packed by `stores_asq`, and gate keys
    encoded as `gsm` sets them."""
    gate = gsm.sparse_attention
    caches = []
    for _ in range(layers):
        stores = filled_stores(stores_asq, batch, length)
        caches.append(
            (
                *stores,
                *encode_gate_keys(
                    torch.randn(batch, 1, stores[0].capacity, gate.gate_head_dim, device="cuda"), gate.gate_key_bits
                ),
            )
        )
    return caches


def selection(gate_q: torch.Tensor, layer: Layer, k: int, fused: bool = True) -> torch.Tensor:
    """The k positions [B, 1, k] the gate query [B, 1, 1, dg] picks from `layer`'s gate keys as a decode step
    does (`decode_attention.select_keys`): gate scores with the newest position forced in (no sinks or
    recent window; the length read on the device), then the CUDA top-k, or torch.topk without `fused`."""
    scores = gate_scores(gate_q, layer[2], layer[3], layer[0].lengths.device, 0, 0)
    k = static_k(k, 1, scores.shape[-1])  # no sinks, no window: the own key
    return unordered_top_k(scores, k) if fused else scores.topk(k, dim=-1, sorted=False).indices


def _gsm_ms(query: torch.Tensor, caches: list[Layer], k: int) -> dict[str, float | str]:
    """ms per layer of GSM decode attention (gate scores, top-k, fused gather + dequantize + attend), of its
    first parts alone (gate scores; gate scores and the CUDA top-k; gate scores and torch.topk), and of the
    fused kernel (with its merge) alone: where the time goes; and the configuration the autotuner picked for
    the fused kernel at this shape (its pick moves between runs at small grids)."""
    dim = query.shape[-1]
    gate_q = torch.randn(query.shape[0], 1, 1, caches[0][2].shape[-1], device="cuda")
    index = selection(gate_q, caches[0], k)
    rows = [(c[0].packed_rows(), c[1].packed_rows()) for c in caches]
    return {
        "gsm_ms": per_layer_ms(
            [
                lambda c=c, r=r: fused_decode_attention(query, *r, selection(gate_q, c, k), None, dim**-0.5)
                for c, r in zip(caches, rows)
            ]
        ),
        "gate_scores_ms": per_layer_ms(
            [lambda c=c: gate_scores(gate_q, c[2], c[3], c[0].lengths.device, 0, 0) for c in caches]
        ),
        "gate_scores_topk_ms": per_layer_ms([lambda c=c: selection(gate_q, c, k) for c in caches]),
        "gate_scores_torch_topk_ms": per_layer_ms([lambda c=c: selection(gate_q, c, k, fused=False) for c in caches]),
        "attend_ms": per_layer_ms(
            [lambda r=r: fused_decode_attention(query, *r, index, None, dim**-0.5) for r in rows]
        ),
        "autotuned_config": config_name(autotuned_config()),
    }  # the latest launch's: this shape's pick


@torch.no_grad()
def attention_rows(contexts: list[int], batches: list[int], ks: list[int], gsm: GSMConfig) -> list[dict]:
    """Per-step decode attention time per layer, GSM vs dense SDPA, for every shape / context / batch / k,
    ASQ and the gate keys as `gsm` sets them (the bits of the layers `layer_bits` does not name)."""
    rows = []
    for shape, (q_heads, kv_heads, dim) in SHAPES.items():
        asq_k, asq_v = compressors(gsm, kv_heads, dim)
        for length in contexts:
            for batch in batches:
                query = torch.randn(batch, q_heads, 1, dim, device="cuda", dtype=torch.bfloat16)
                dense_bytes = 2 * batch * kv_heads * length * dim * 2
                layers = layers_per_graph(dense_bytes)
                dense = dense_sdpa_ms(query, kv_heads, length, layers)
                torch.cuda.empty_cache()
                caches = layer_caches(gsm, (asq_k, asq_v), batch, length, layers)
                for k in ks:
                    times = _gsm_ms(query, caches, k)
                    sparse = times["gsm_ms"]
                    row = {
                        "shape": shape,
                        "context": length,
                        "batch": batch,
                        "k": k,
                        "layers_per_graph": layers,
                        "dense_ms": dense,
                        **times,
                        "speedup": dense / sparse,
                        "dense_bandwidth_TBps": dense_bytes / dense / 1e9,
                    }
                    rows.append(row)
                    print(
                        f"{shape:>8} {length:>7} {batch:>3} {k:>5} dense {dense * 1e3:9.1f} us  gsm "
                        f"{sparse * 1e3:9.1f} us (scores {times['gate_scores_ms'] * 1e3:.1f}, +top-k "
                        f"{times['gate_scores_topk_ms'] * 1e3:.1f}, +torch.topk "
                        f"{times['gate_scores_torch_topk_ms'] * 1e3:.1f}, attend {times['attend_ms'] * 1e3:.1f} "
                        f"[{times['autotuned_config']}])  "
                        f"x{dense / sparse:6.2f}  [{layers} layers per graph]",
                        flush=True,
                    )
                del caches
                torch.cuda.empty_cache()
    return rows


def _gsm_model(adapter: str | None, device: torch.device, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    model, _ = load_model_and_tokenizer("smollm2-135m", dtype=dtype)
    model.to(device)
    if adapter:
        load_gsm(model, adapter, mode="sparse")
    else:  # untrained modules: the same draw in every run and for every dtype, so agreement repeats
        torch.manual_seed(MODULE_SEED)
        inject_gsm(model, load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm, mode="sparse")
    return model.eval()  # the GSM modules are built on the model's device


def _timed_generate(
    model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int, cache_factory: Callable[[], object | None]
) -> tuple[torch.Tensor, float, float, int]:
    """(tokens, seconds for the whole call, seconds for the prompt alone, bytes the cache holds on the device)."""

    def run(tokens: int) -> tuple[torch.Tensor, float, int]:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        cache = cache_factory()
        tic = time.perf_counter()
        kwargs = cache_kwargs(model, cache) if cache is not None else {"return_dict_in_generate": True}
        out = model.generate(
            prompts, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0, **kwargs
        )
        torch.cuda.synchronize()
        seconds = time.perf_counter() - tic
        if cache is None:
            out, cache = out.sequences, out.past_key_values
        held = torch.cuda.memory_allocated() - base - out.numel() * out.element_size()
        del cache
        return out, seconds, held

    run(new_tokens)  # warm-up: every step's shapes seen once (compiled parts recompile for new shapes at first)
    _, prefill_s, _ = run(1)
    out, total_s, held = run(new_tokens)
    return out, total_s, prefill_s, held


NEAR_TIE = 0.1  # logits: a teacher-forced argmax this close to the generated token's logit is a near-tie


def _agreement(
    model: torch.nn.Module, generated: torch.Tensor, new_tokens: int, against_itself: bool = True
) -> dict[str, float]:
    """Share of generated tokens equal to the teacher-forced argmax of the same model on the same sequence,
    and how far the teacher-forced logits put each mismatch from a tie (the generated token's logit below
    the argmax's): near-ties are rounding differences meeting a discrete step, large gaps amplified ones.

    With `against_itself`, also the teacher-forced pass against itself: its argmax over the first half of the
    new tokens from the whole sequence and from the sequence without its second half. The two passes compute the same
    thing, so this share is a reference level for how much rounding (amplified by ASQ's code rounding
    and the top-k) alone moves the argmax at this precision (over the first half of the tokens only)."""
    logits = model(generated, use_cache=False, logits_to_keep=new_tokens + 1).logits[:, :-1]
    logits = logits if logits.dtype == torch.float64 else logits.float()
    tokens = generated[:, -new_tokens:]
    gap = logits.max(-1).values - logits.gather(-1, tokens[..., None])[..., 0]
    mismatch = logits.argmax(-1) != tokens
    result = {
        "agreement": 1 - mismatch.float().mean().item(),
        "mismatch_max_logit_gap": gap[mismatch].max().item() if mismatch.any() else 0.0,
        "agreement_outside_near_ties": 1 - (mismatch & (gap > NEAR_TIE)).float().mean().item(),
    }
    if against_itself:
        half = new_tokens // 2
        shorter = model(
            generated[:, : generated.shape[1] - half], use_cache=False, logits_to_keep=new_tokens - half + 1
        ).logits[:, :-1]
        same = shorter.argmax(-1) == logits[:, : new_tokens - half].argmax(-1)
        result["teacher_forced_self_agreement"] = same.float().mean().item()
    return result


@torch.no_grad()
def exact_agreement(prompt: torch.Tensor, adapter: str | None, new_tokens: int, dtype: torch.dtype) -> dict[str, float]:
    """Token agreement of cached GSM decoding with teacher forcing in fp32 or fp64 (batch 1, the PyTorch decode
    path for fp64, which the kernels do not take). In fp64 the two paths differ only by fp64 rounding, which
    no ASQ code rounding or top-k boundary meets in practice: agreement there shows they compute the same
    function (the prompt prefilled with `prefill="sparse"`, the teacher-forced pass, not the default dense
    prefill); fp32 shows how much of the bf16 disagreement rounding alone explains."""
    gsm = _gsm_model(adapter, torch.device("cuda"), torch.float32)
    if dtype == torch.float64:
        gsm.double()
    cache = GSMCache(gsm, capacity=prompt.shape[1] + new_tokens, prefill="sparse")  # fp64: the PyTorch decode path
    out = gsm.generate(
        prompt.cuda(),
        **cache_kwargs(gsm, cache),
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return _agreement(gsm, out, new_tokens)


@torch.no_grad()
def end_to_end(
    dense: torch.nn.Module, prompts_all: torch.Tensor, adapter: str | None, new_tokens: int, batches: list[int]
) -> list[dict]:
    """Greedy generation tokens/s, GSM adapter vs the dense base (bf16), and token agreement with teacher forcing."""
    device = torch.device("cuda")
    prompt_len = prompts_all.shape[1]
    dense.to(device)
    gsm = _gsm_model(adapter, device)
    rows = []
    for batch in batches:
        prompts = prompts_all[:batch].to(device)
        dense_out, dense_s, dense_prefill, dense_bytes = _timed_generate(dense, prompts, new_tokens, lambda: None)
        gsm_out, gsm_s, gsm_prefill, gsm_bytes = _timed_generate(
            gsm, prompts, new_tokens, lambda: GSMCache(gsm, capacity=prompt_len + new_tokens)
        )
        agreement = _agreement(gsm, gsm_out, new_tokens)
        dense_agreement = _agreement(dense, dense_out, new_tokens, against_itself=False)
        generated = batch * new_tokens
        row = {
            "batch": batch,
            "prompt": prompt_len,
            "new_tokens": new_tokens,
            "tokens_per_s_dense": generated / dense_s,
            "tokens_per_s_gsm": generated / gsm_s,
            "decode_tokens_per_s_dense": generated / (dense_s - dense_prefill),
            "decode_tokens_per_s_gsm": generated / (gsm_s - gsm_prefill),
            "kv_bytes_dense": dense_bytes,
            "kv_bytes_gsm": gsm_bytes,
            "kv_bytes_ratio": gsm_bytes / dense_bytes,
            "token_agreement": agreement["agreement"],
            "token_agreement_outside_near_ties": agreement["agreement_outside_near_ties"],
            "teacher_forced_self_agreement": agreement["teacher_forced_self_agreement"],
            "mismatch_max_logit_gap": agreement["mismatch_max_logit_gap"],
            "token_agreement_dense_bf16": dense_agreement["agreement"],
            "mismatch_max_logit_gap_dense_bf16": dense_agreement["mismatch_max_logit_gap"],
            "same_tokens_as_dense": (dense_out[:, prompt_len:] == gsm_out[:, prompt_len:]).float().mean().item(),
        }
        rows.append(row)
        print(
            f"e2e batch {batch}: dense {row['tokens_per_s_dense']:.0f} tok/s, gsm {row['tokens_per_s_gsm']:.0f} "
            f"tok/s; KV {dense_bytes / 2**20:.1f} -> {gsm_bytes / 2**20:.1f} MiB; "
            f"agreement {agreement['agreement']:.4f} "
            f"({agreement['agreement_outside_near_ties']:.4f} outside near-ties, largest mismatch gap "
            f"{agreement['mismatch_max_logit_gap']:.3f})",
            flush=True,
        )
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--adapter", default=None, help="a GSM export; default: the joint recipe's fresh modules")
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--ks", default="64,2048")
    parser.add_argument(
        "--asq-bits",
        type=int,
        choices=(2, 4, 8),
        default=None,
        help="attention rows: K's and V's residual bits in place of the joint recipe's",
    )
    parser.add_argument("--unrotated", action="store_true", help="attention rows: ASQ without rotate_residuals")
    parser.add_argument("--prompt", type=int, default=4096)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    try:
        import flash_attn  # noqa: F401

        flash = "installed but not benchmarked"
    except ImportError:
        flash = "not installed on this machine; dense SDPA picks its own backend (flash/cuDNN/efficient)"
    overrides = (
        [f"gsm.kv_compression.quant_bits={args.asq_bits}", "gsm.kv_compression.value_quant_bits=null"]
        if args.asq_bits
        else []
    ) + (["gsm.kv_compression.rotate_residuals=false"] if args.unrotated else [])
    gsm = load_recipe(str(REPO / "recipes" / "joint.yaml"), overrides).gsm
    rows = attention_rows(ints(args.contexts), ints(args.batches), ints(args.ks), gsm)
    dense, tokenizer = load_model_and_tokenizer("smollm2-135m", dtype=torch.bfloat16)
    prompts = pack_tokens(load_text_dataset(args.eval_data), tokenizer, args.prompt)
    e2e = end_to_end(dense, prompts, args.adapter, args.new_tokens, ints(args.batches))
    del dense

    def speedup(context: int, batch: int, k: int, shape: str = "llama8b") -> float:
        return next(
            r["speedup"] for r in rows if (r["shape"], r["context"], r["batch"], r["k"]) == (shape, context, batch, k)
        )

    exact = {
        name: exact_agreement(prompts[1:2], args.adapter, args.new_tokens, dtype)
        for name, dtype in (("fp32", torch.float32), ("fp64", torch.float64))
    }
    for name, agreement in exact.items():
        print(
            f"token agreement in {name}: {agreement['agreement']:.4f} ({agreement['agreement_outside_near_ties']:.4f} "
            f"outside near-ties; teacher forcing against itself {agreement['teacher_forced_self_agreement']:.4f})"
        )
    first = e2e[0]
    result = {
        "attn_speedup_32k_bs1_k2048": speedup(32768, 1, 2048),
        "attn_speedup_32k_bs16_k2048": speedup(32768, 16, 2048),
        "attn_speedup_32k_bs1_k2048_smollm2": speedup(32768, 1, 2048, "smollm2"),
        "attn_speedup_32k_bs16_k2048_smollm2": speedup(32768, 16, 2048, "smollm2"),
        "e2e_tokens_per_s_gsm": first["tokens_per_s_gsm"],
        "e2e_tokens_per_s_dense": first["tokens_per_s_dense"],
        "kv_bytes_gsm": first["kv_bytes_gsm"],
        "kv_bytes_dense": first["kv_bytes_dense"],
        "token_agreement": min(r["token_agreement"] for r in e2e),
        "token_agreement_fp32": exact["fp32"]["agreement"],
        "token_agreement_fp64": exact["fp64"]["agreement"],
        "teacher_forced_self_agreement": min(r["teacher_forced_self_agreement"] for r in e2e),
        "teacher_forced_self_agreement_fp32": exact["fp32"]["teacher_forced_self_agreement"],
        "token_agreement_outside_near_ties": min(r["token_agreement_outside_near_ties"] for r in e2e),
        "token_agreement_fp32_outside_near_ties": exact["fp32"]["agreement_outside_near_ties"],
        "near_tie_logit_gap": NEAR_TIE,
        "adapter": args.adapter or "recipes/joint.yaml modules, untrained",
        "attention_rows_asq": {
            "bits_k_v": list(gsm.kv_compression.bits()),
            "cluster_num": gsm.kv_compression.cluster_num,
            "block_size": gsm.kv_compression.block_size,
            "rotate_residuals": gsm.kv_compression.rotate_residuals,
            "gate_head_dim": gsm.sparse_attention.gate_head_dim,
            "gate_key_bits": gsm.sparse_attention.gate_key_bits,
        },
        "flash_attn": flash,
        "attention": rows,
        "end_to_end": e2e,
    }
    write_result(Path(args.result), result)
    print(f"plot: {plot_decode_speedup(rows, Path(args.result).with_suffix('.png'))}")


if __name__ == "__main__":
    main()

"""Where one decode step's time goes, per kernel: GSM's token step (the generation engine's, replayed from
its CUDA graph) and the dense engine's (`gsm_train.inference.dense_engine`, likewise captured), at the
8B shape by default, after a prompt of `--context` tokens.

Each method's step is called `--steps` times under torch.profiler after warm-up calls (the first of
which captures the graph). On CUDA the table is the GPU kernels (and copies) the replays ran: name,
calls per step, microseconds per step, share of the step's kernel time, and beside the kernels' sum
(`step_us`) the step's wall time without the profiler, replayed back to back (`replay_us`: the gaps between
its kernels added) and synchronized after each call as benchmarks.generate times a token (`synced_us`: the
host's part added), and the configurations the decode kernel's autotuner chose (`decode_configs`); on the CPU
(no graphs) the table only, for the PyTorch ops' own CPU time, a smoke test of the script rather than a
figure. Resumable: a method already in --result with the same settings is not profiled again; the JSON is
written after each.

`--count` times nothing: it counts the aten ops one token step runs, eagerly, per decoder layer and
outside the layers (`count_ops`: views are left out, since they launch nothing). On the CPU the step
takes the PyTorch path; with `TRITON_INTERPRET=1` it takes the fused kernels' path, as on a GPU, the
kernels run by Triton's interpreter (their insides not counted: on a GPU each is one launch).
`--model tiny` takes recipes/joint.yaml's GSM settings at sizes the tiny model fits (`TINY_OVERRIDES`); `--model
smollm2` SmolLM2-135M's shapes with recipes/joint_long.yaml's modules (the 8k export's), as
benchmarks.prefill_profile.
`--count-outside` counts what GSM's generation runs outside the part a CUDA graph captures (`count_outside`):
per new token, the ops of `model.generate`'s loop (GSM's greedy loop, `inference.greedy_loop`), of transformers'
loop over the same cache, and of a plain greedy loop around the token step,
and the ops of one `GSMCache.pack_full_tail` (every `block_size` tokens), on the CPU, eagerly.
`--fused` runs both engines' token steps with `fused_decode` (RMSNorm, RoPE and SwiGLU as one Triton kernel
each, `gsm_train.inference.decode_fusion`); counted on the CPU it needs `TRITON_INTERPRET=1` as above.
`--every-key` profiles a third method, `gsm_every_key`: GSM's modules and cache in dense mode, every layer
reading every key of its compressed cache (the block kernel, no gate scores or top-k): what a short
context's token step costs when it skips the selection. `--serial-selection` profiles `gsm_serial_selection`:
GSM with each layer's gate and top-k inside its attention, after its projections, not started ahead of them
on a side stream (`GSMCache(overlap_selection=False)`).

    python -m benchmarks.decode_step_profile --result OUT.json [--model 8b|smollm2|tiny] [--context 32768] [--batch 1]
        [--steps 20] [--top 25] [--count | --count-outside] [--fused] [--every-key] [--serial-selection]
        [--device cuda|cpu]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import REPO, write_result
from gsm_train.attention import gsm_adapters, inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.families import decoder_stack, model_dims
from gsm_train.models.model_zoo import random_model, tiny_model

# --model tiny: recipes/joint.yaml's GSM settings at sizes that fit the tiny model and a short prompt
TINY_OVERRIDES = ("gsm.sparse_attention.top_k=16", "gsm.sparse_attention.k_min=8", "gsm.kv_compression.block_size=16")
STARTED = time.perf_counter()


def say(message: str) -> None:
    print(f"[{time.perf_counter() - STARTED:7.1f} s] {message}", flush=True)


def profile_step(step: Callable[[], object], steps: int, cuda: bool) -> list[dict]:
    """Per kernel (`cuda`: the step runs on the GPU) or per op's own CPU time, over `steps` calls of `step`:
    name, calls per step, microseconds per step and share of the total, the largest first."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize()
    rows = []
    per_call = _per_call_us(prof.events(), cuda)
    for event in prof.key_averages():
        total = event.device_time_total if cuda else event.self_cpu_time_total
        if total > 0:
            row = {"name": event.key[:160], "calls": event.count / steps, "total_us": total / steps}
            rows.append(row | _call_spread(per_call.get(event.key, [])))
    whole = sum(row["total_us"] for row in rows)
    for row in rows:
        row["share"] = row["total_us"] / whole
    return sorted(rows, key=lambda row: -row["total_us"])


def _per_call_us(events: list, cuda: bool) -> dict[str, list[float]]:
    """Each kernel's (or op's) duration per call, in microseconds, by name."""
    calls: dict[str, list[float]] = {}
    for event in events:
        duration = event.device_time_total if cuda else event.self_cpu_time_total  # as `key_averages` sums them
        if duration > 0:
            calls.setdefault(event.key, []).append(duration)
    return calls


def _call_spread(durations: list[float]) -> dict:
    """`median_call_us` and `largest_calls_us` (the four longest calls): a kernel whose calls differ (a dense
    layer's attention beside the selecting layers') shows it here, where its total hides it."""
    if not durations:
        return {}
    ordered = sorted(durations)
    return {"median_call_us": ordered[len(ordered) // 2], "largest_calls_us": ordered[-4:][::-1]}


class OpCounter(TorchDispatchMode):
    """Counts the aten ops run inside it by decoder layer of `model` (`layers[i]`, op -> calls) and outside
    the layers (`outside`). Views are left out (they launch nothing), and so are the ops Triton's
    interpreter runs inside a kernel (on a GPU each kernel is one launch)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.blocks = list(decoder_stack(model).layers)
        self.layers: list[Counter] = [Counter() for _ in self.blocks]
        self.outside: Counter = Counter()
        self.current: Counter = self.outside
        self.handles: list[Any] = []

    def __enter__(self) -> OpCounter:
        for block, counts in zip(self.blocks, self.layers, strict=True):
            self.handles.append(block.register_forward_pre_hook(lambda *_, c=counts: setattr(self, "current", c)))
            self.handles.append(block.register_forward_hook(lambda *_: setattr(self, "current", self.outside)))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        super().__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        returns = func._schema.returns
        view = bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write
        if not view and func is not torch.ops.aten.lift_fresh.default and not _inside_triton():
            self.current[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _inside_triton() -> bool:
    """Whether the running op was called by Triton (its interpreter running a kernel on the CPU)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("__name__", "").startswith("triton."):
            return True
        frame = frame.f_back
    return False


def count_ops(step: Callable[[], object], model: nn.Module) -> dict:
    """The aten ops one call of `step` runs (`OpCounter`): `outside` the decoder layers and `per_layer`
    (totals), and `ops`, each layer's op -> calls."""
    with torch.no_grad(), OpCounter(model) as counter:
        step()
    return {
        "outside": sum(counter.outside.values()),
        "per_layer": [sum(layer.values()) for layer in counter.layers],
        "ops": [dict(sorted(layer.items())) for layer in counter.layers],
    }


class PhaseCounter(TorchDispatchMode):
    """Counts the aten ops run inside it (views aside, as `OpCounter`) by the phase named in `phase`."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "outside"
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        returns = func._schema.returns
        if not (bool(returns) and returns[0].alias_info is not None and not returns[0].alias_info.is_write):
            self.counts[self.phase] += 1
        return func(*args, **(kwargs or {}))

    def within(self, phase: str, call: Callable[..., Any]) -> Callable[..., Any]:
        """`call` with its ops counted under `phase` (the phase before it resumes after it)."""

        def counted(*args: Any, **kwargs: Any) -> Any:
            before, self.phase = self.phase, phase
            try:
                return call(*args, **kwargs)
            finally:
                self.phase = before

        return counted


def count_outside(model: nn.Module, ids: torch.Tensor, tokens: int) -> dict:
    """GSM's generation of `tokens` new tokens after `ids` [B, T], eagerly, its ops counted by phase
    (`PhaseCounter`): `step` (the model's forward of one token, what a CUDA graph replays on a GPU), `pack`
    (`GSMCache.pack_full_tail`, the eager pack inside it), `prefill`, and the rest, the driving loop's. Per
    loop (`generate`: `model.generate` as benchmarks.generate times it, `generate_timed`, a plain greedy call
    decoded by `inference.greedy_loop`; `transformers_loop`: the same call decoded by transformers' loop,
    `enable_gsm_generation(greedy_loop=False)`; `plain_loop`: an argmax per token, as its `plain_loop_generate`):
    `per_token`, the loop's ops from one token step to the next (the mean over the steps), `step`, the ops of
    a token step that packs nothing, and `per_pack`, the ops of a pack (None if none packed: `tokens` must
    reach past the prompt's last block). On a GPU a replayed step adds its input copies and the logits'
    clone (3 ops)."""
    from benchmarks.generate import generate_timed

    enable_gsm_generation(model, cuda_graphs=False)
    base = model.gsm_base_forward

    def run(loop: str) -> dict:
        enable_gsm_generation(model, cuda_graphs=False, greedy_loop=loop != "transformers_loop")
        counter, cache = PhaseCounter(), GSMCache(model, capacity=ids.shape[1] + tokens + 1)
        pack = counter.within("pack", cache.pack_full_tail)
        steps, packed = [], set()  # the counts as each token step began; the steps that packed

        def counted_pack() -> bool:
            did = pack()
            if did:
                packed.add(len(steps) - 1)
            return did

        def counted_forward(**kwargs: Any) -> Any:
            if kwargs["input_ids"].shape[1] > 1:
                return counter.within("prefill", base)(**kwargs)
            steps.append(dict(counter.counts))
            return counter.within("step", base)(**kwargs)

        cache.pack_full_tail, model.gsm_base_forward = counted_pack, counted_forward
        kwargs = cache_kwargs(model, cache)
        try:
            with torch.no_grad(), counter:
                if loop != "plain_loop":
                    generate_timed(model, ids, tokens, **kwargs)
                else:
                    token = model(input_ids=ids, use_cache=True, logits_to_keep=1, **kwargs).logits.argmax(-1)
                    for _ in range(tokens - 1):
                        token = model(input_ids=token, use_cache=True, logits_to_keep=1, **kwargs).logits.argmax(-1)
        finally:
            model.gsm_base_forward = base
        ends = [*steps[1:], dict(counter.counts)]  # each step's counts until the next began
        spans = [{phase: end.get(phase, 0) - begin.get(phase, 0) for phase in end} for begin, end in zip(steps, ends)]
        packs = [spans[at]["pack"] for at in sorted(packed)]
        return {
            "per_token": sum(span["outside"] for span in spans[:-1]) / (len(spans) - 1),
            "step": next(span["step"] for at, span in enumerate(spans) if at not in packed),
            "per_pack": packs[0] if packs else None,
        }

    try:
        return {loop: run(loop) for loop in ("generate", "transformers_loop", "plain_loop")}
    finally:
        enable_gsm_generation(model, cuda_graphs=False)


def profile_model(name: str, device: str) -> nn.Module:
    """`name`'s model with random weights (seeded): `tiny` (fp32), `smollm2` (`random-smollm2-135m`, SmolLM2-135M's
    shapes) or `8b` (`random-llama3-8b`, with room for a 128k prompt), both bf16."""
    torch.manual_seed(0)
    if name == "tiny":
        return tiny_model("llama").to(device)
    if name == "smollm2":
        return random_model("random-smollm2-135m", torch.bfloat16, device)
    return random_model("random-llama3-8b", torch.bfloat16, device, max_position_embeddings=131072 + 1024)


def _gsm_config(name: str) -> GSMConfig:
    """The GSM modules profiled on `name`: recipes/joint.yaml's (`TINY_OVERRIDES` on the tiny model), on
    `smollm2` recipes/joint_long.yaml's (the 8k export's), gates at random either way."""
    from benchmarks.generate import joint_gsm_config

    if name == "smollm2":
        return load_recipe(str(REPO / "recipes" / "joint_long.yaml"), ["gsm.sparse_attention.gate_init=random"]).gsm
    return joint_gsm_config(*TINY_OVERRIDES) if name == "tiny" else joint_gsm_config()


def attach_gsm(model: nn.Module, name: str, mode: str = "sparse") -> None:
    """`_gsm_config(name)`'s modules on `model` (once), in `mode` (sparse or dense)."""
    if not gsm_adapters(model):
        inject_gsm(model, _gsm_config(name))
    set_gsm_mode(model, mode)


def prompt_ids(model: nn.Module, batch: int, context: int) -> torch.Tensor:
    """Random prompt tokens [batch, context] (seeded) on the model's device."""
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(1)
    return torch.randint(0, model.config.vocab_size, (batch, context), generator=generator).to(device)


def load_result(path: Path, settings: dict) -> dict:
    """The result file at `path` if it was written with `settings`, else a fresh one holding them."""
    result = json.loads(path.read_text()) if path.exists() else {}
    return result if result.get("settings") == settings else {"settings": settings}


def run_methods(
    path: Path, result: dict, methods: list[tuple[str, Callable[[], dict]]], show: Callable[[str, dict], None]
) -> None:
    """Each (name, measure) of `methods` in order, unless `result` holds it already (an earlier run with the
    same settings); `result` is written to `path` after each; `show(name, figures)` prints each."""
    for method, run in methods:
        if method in result:
            say(f"{method}: profiled by an earlier run")
        else:
            result[method] = run()
            write_result(path, result)
        show(method, result[method])


def dense_step(
    model: nn.Module, ids: torch.Tensor, extra: int, cuda_graphs: bool = True, fused: bool = False
) -> Callable[[], object]:
    """The dense engine's token step after `ids` [B, T] (captured on CUDA with `cuda_graphs`; `fused`:
    with `fused_decode`), room for `extra` more calls."""
    engine = DenseEngine(model, cuda_graphs=cuda_graphs, fused_decode=fused)
    cache = engine.new_cache(ids.shape[0], ids.shape[1] + extra)
    engine.prefill(cache, ids)
    step = engine.token_step(cache)
    token = ids[:, -1:]
    return lambda: step(token)


def gsm_step(
    model: nn.Module,
    ids: torch.Tensor,
    extra: int,
    cuda_graphs: bool = True,
    fused: bool = False,
    dense_block_kernel: bool = True,
    overlap_selection: bool = True,
) -> Callable[[], object]:
    """GSM's token step after `ids` [B, T] through the generation engine (captured on CUDA at its first call
    with `cuda_graphs`; `fused`: with `fused_decode`; `dense_block_kernel`: its dense layers read a block a
    tile; `overlap_selection`: each layer's selection starts before its projections, on a side stream). On the
    CPU under Triton's interpreter the cache takes the fused kernels' path."""
    enable_gsm_generation(
        model,
        cuda_graphs=cuda_graphs,
        fused_decode=fused,
        dense_block_kernel=dense_block_kernel,
        overlap_selection=overlap_selection,
    )
    interpreted = not ids.is_cuda and os.environ.get("TRITON_INTERPRET") == "1"
    cache = GSMCache(model, capacity=ids.shape[1] + extra, fused=True if interpreted else None)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    token = ids[:, -1:]

    def step() -> object:
        with torch.no_grad():
            return model(input_ids=token, use_cache=True, **cache_kwargs(model, cache))

    return step


def measure(
    make: Callable[..., Callable[[], object]],
    model: nn.Module,
    ids: torch.Tensor,
    steps: int,
    count: bool = False,
    fused: bool = False,
) -> dict:
    """One method's profile: warm-up calls (capture, autotuning), then `steps` profiled calls. With
    `count`: eager steps, one warm-up call, then `count_ops` of one. `fused`: the steps run `fused_decode`."""
    warmup = 1 if count else 3
    calls = warmup + (1 if count else 3) * steps + 1  # on CUDA the walls' 2 x `steps` calls too
    step = make(model, ids, calls, cuda_graphs=not count, fused=fused)
    for _ in range(warmup):
        step()
    if count:
        return count_ops(step, model)
    kernels = profile_step(step, steps, ids.is_cuda)
    total = sum(row["total_us"] for row in kernels)
    figures = {"step_us": total, "per_layer_us": total / model_dims(model)["layers"], "kernels": kernels}
    if ids.is_cuda:
        figures |= step_walls(step, steps) | {"decode_configs": decode_kernel_configs()}
    return figures


def step_walls(step: Callable[[], object], steps: int) -> dict:
    """What a call of `step` takes on CUDA outside the profiler, in us: `replay_us`, `steps` calls issued back
    to back between two CUDA events (the device's time a step, the gaps between its kernels included, while the
    host issues calls faster than the device runs them), and `synced_us`, each call followed by a device
    synchronize on the host's clock, as benchmarks.generate times a token. Against `step_us` (the kernels'
    own time) they split a token's time outside the kernels into gaps inside the step and the host's part."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        step()
    end.record()
    torch.cuda.synchronize()
    began = time.perf_counter()
    for _ in range(steps):
        step()
        torch.cuda.synchronize()
    synced = (time.perf_counter() - began) * 1e6 / steps
    return {"replay_us": start.elapsed_time(end) * 1e3 / steps, "synced_us": synced}


def decode_kernel_configs() -> dict[str, str]:
    """The configuration the autotuner chose for each shape the fused decode kernel has run in this process
    (`autotuned_configs`' keys), as benchmarks.decode names them; empty if it ran none."""
    from benchmarks.decode import config_name
    from gsm_train.kernels.sparse_decode import autotuned_configs

    return {" ".join(map(str, key)): config_name(config) for key, config in autotuned_configs().items()}


def print_counts(method: str, result: dict) -> None:
    per_layer = result["per_layer"]
    print(f"\n{method}: {result['outside']} ops outside the layers; per layer {per_layer}")
    for layer in sorted({per_layer.index(n) for n in set(per_layer)}):  # one layer of each count
        print(
            f"  layer {layer}: "
            + ", ".join(f"{op.removeprefix('aten.')} {n}" for op, n in result["ops"][layer].items())
        )


def print_outside(method: str, result: dict) -> None:
    for loop, counts in result.items():
        print(
            f"{method}, {loop}: {counts['per_token']:.1f} ops per token outside the step "
            f"({counts['step']:.1f} in it); {counts['per_pack']} per pack"
        )


def print_table(method: str, result: dict, top: int) -> None:
    print(f"\n{method}: {result['step_us']:.1f} us per step ({result['per_layer_us']:.1f} per layer)")
    print_kernels(result["kernels"], top)


def print_kernels(kernels: list[dict], top: int) -> None:
    """The `top` rows of a `profile_step` table."""
    print(f"{'kernel':<90} {'calls':>7} {'total us':>10} {'share':>7}")
    for row in kernels[:top]:
        print(f"{row['name'][:90]:<90} {row['calls']:7.1f} {row['total_us']:10.1f} {row['share']:7.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", default="8b", choices=["8b", "smollm2", "tiny"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--count", action="store_true", help="count each step's aten ops per layer; no timing")
    parser.add_argument(
        "--dense-block-kernel",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="GSM's dense layers read a compressor block a tile (--no-dense-block-kernel: the selection kernel)",
    )
    parser.add_argument(
        "--count-outside", action="store_true", help="count GSM's ops outside its captured step (per token, per pack)"
    )
    parser.add_argument(
        "--every-key", action="store_true", help="also GSM in dense mode: every layer reads every compressed key"
    )
    parser.add_argument(
        "--fused", action="store_true", help="token steps with fused RMSNorm, RoPE and SwiGLU kernels (both engines)"
    )
    parser.add_argument(
        "--serial-selection",
        action="store_true",
        help="also GSM with each layer's selection inside its attention, not overlapped with its projections",
    )
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default=None,
        help="default: cuda where there is one (8b, smollm2), cpu for tiny",
    )
    args = parser.parse_args(argv)
    settings = {"model": args.model, "context": args.context, "batch": args.batch, "steps": args.steps}
    settings |= {"count": True} if args.count else {}
    settings |= {"count_outside": True} if args.count_outside else {}
    settings |= {"fused": True} if args.fused else {}
    settings |= {"every_key": True} if args.every_key else {}
    settings |= {"serial_selection": True} if args.serial_selection else {}
    settings |= {"dense_block_kernel": args.dense_block_kernel}
    settings |= {"device": args.device} if args.device else {}
    path = Path(args.result)
    result = load_result(path, settings)
    model = profile_model(
        args.model, args.device or ("cuda" if torch.cuda.is_available() and args.model != "tiny" else "cpu")
    )
    ids = prompt_ids(model, args.batch, args.context)
    if args.count_outside:
        attach_gsm(model, args.model)
        tokens = _gsm_config(args.model).kv_compression.block_size
        run_methods(path, result, [("gsm_outside", lambda: count_outside(model, ids, tokens))], print_outside)
        return

    def method(name: str, make: Callable[..., Callable[[], object]]) -> tuple[str, Callable[[], dict]]:
        def run() -> dict:
            if name.startswith("gsm"):
                attach_gsm(model, args.model, "dense" if name == "gsm_every_key" else "sparse")
            what = "one counted step" if args.count else f"{args.steps} profiled steps"
            say(f"{name}: prefill of {args.context} tokens, warm-up, {what}")
            return measure(make, model, ids, args.steps, args.count, args.fused)

        return name, run

    def show(name: str, figures: dict) -> None:
        if args.count:
            print_counts(name, figures)
        else:
            print_table(name, figures, args.top)

    gsm = functools.partial(gsm_step, dense_block_kernel=args.dense_block_kernel)
    methods = [method("dense_engine", dense_step), method("gsm", gsm)]
    methods += [method("gsm_every_key", gsm)] if args.every_key else []
    serial = functools.partial(gsm, overlap_selection=False)
    methods += [method("gsm_serial_selection", serial)] if args.serial_selection else []
    run_methods(path, result, methods, show)


if __name__ == "__main__":
    main()

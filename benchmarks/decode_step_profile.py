"""Where one decode step's time goes, per kernel: GSM's token step (the generation engine's, replayed from
its CUDA graph) and the dense engine's (`gsm_train.inference.dense_engine`, likewise captured), at the
8B shape by default, after a prompt of `--context` tokens.

Each method's step is called `--steps` times under torch.profiler after warm-up calls (the first of
which captures the graph). On CUDA the table is the GPU kernels (and copies) the replays ran: name,
calls per step, microseconds per step, share of the step's kernel time; on the CPU (no graphs) the same
for the PyTorch ops' own CPU time, a smoke test of the script rather than a figure. Resumable: a method
already in --result with the same settings is not profiled again; the JSON is written after each.

    python -m benchmarks.decode_step_profile --result OUT.json [--model 8b] [--context 32768] [--batch 1]
        [--steps 20] [--top 25]
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import write_result
from gsm_train.attention import inject_gsm, set_gsm_mode
from gsm_train.config.schema import GSMConfig
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.families import model_dims
from gsm_train.models.model_zoo import random_model, tiny_model

# --model tiny: GSM settings that fit the tiny model's shapes (the 8B shape takes recipes/joint.yaml's)
TINY_GSM = {
    "sparse_attention": {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4, "hidden_dim": 8},
}
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
    for event in prof.key_averages():
        total = event.device_time_total if cuda else event.self_cpu_time_total
        if total > 0:
            rows.append({"name": event.key[:160], "calls": event.count / steps, "total_us": total / steps})
    whole = sum(row["total_us"] for row in rows)
    for row in rows:
        row["share"] = row["total_us"] / whole
    return sorted(rows, key=lambda row: -row["total_us"])


def _model(name: str) -> nn.Module:
    torch.manual_seed(0)
    if name == "tiny":
        return tiny_model("llama")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return random_model("random-llama3-8b", torch.bfloat16, device, max_position_embeddings=131072 + 1024)


def _gsm_config(name: str) -> GSMConfig:
    if name == "tiny":
        return GSMConfig.model_validate(TINY_GSM)
    from benchmarks.generate import joint_gsm_config

    return joint_gsm_config()


def dense_step(model: nn.Module, ids: torch.Tensor, extra: int) -> Callable[[], object]:
    """The dense engine's token step after `ids` [B, T] (captured on CUDA), room for `extra` more calls."""
    engine = DenseEngine(model)
    cache = engine.new_cache(ids.shape[0], ids.shape[1] + extra)
    engine.prefill(cache, ids)
    step = engine.token_step(cache)
    token = ids[:, -1:]
    return lambda: step(token)


def gsm_step(model: nn.Module, ids: torch.Tensor, extra: int) -> Callable[[], object]:
    """GSM's token step after `ids` [B, T] through the generation engine (captured on CUDA at its first call)."""
    cache = GSMCache(model, capacity=ids.shape[1] + extra)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))
    token = ids[:, -1:]

    def step() -> object:
        with torch.no_grad():
            return model(input_ids=token, use_cache=True, **cache_kwargs(model, cache))

    return step


def measure(make: Callable[..., Callable[[], object]], model: nn.Module, ids: torch.Tensor, steps: int) -> dict:
    """One method's profile: warm-up calls (capture, autotuning), then `steps` profiled calls."""
    warmup = 3
    step = make(model, ids, warmup + steps + 1)
    for _ in range(warmup):
        step()
    kernels = profile_step(step, steps, ids.is_cuda)
    total = sum(row["total_us"] for row in kernels)
    return {"step_us": total, "per_layer_us": total / model_dims(model)["layers"], "kernels": kernels}


def print_table(method: str, result: dict, top: int) -> None:
    print(f"\n{method}: {result['step_us']:.1f} us per step ({result['per_layer_us']:.1f} per layer)")
    print(f"{'kernel':<90} {'calls':>7} {'total us':>10} {'share':>7}")
    for row in result["kernels"][:top]:
        print(f"{row['name'][:90]:<90} {row['calls']:7.1f} {row['total_us']:10.1f} {row['share']:7.3f}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--result", required=True)
    parser.add_argument("--model", default="8b", choices=["8b", "tiny"])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args(argv)
    path = Path(args.result)
    result = json.loads(path.read_text()) if path.exists() else {}
    settings = {"model": args.model, "context": args.context, "batch": args.batch, "steps": args.steps}
    if result.get("settings") != settings:
        result = {"settings": settings}
    model = _model(args.model)
    device = next(model.parameters()).device
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (args.batch, args.context), generator=torch.Generator().manual_seed(1)).to(device)
    for method, make in (("dense_engine", dense_step), ("gsm", gsm_step)):
        if method in result:
            say(f"{method}: profiled by an earlier run")
        else:
            if method == "gsm":
                inject_gsm(model, _gsm_config(args.model), mode="sparse")
                enable_gsm_generation(model)
                set_gsm_mode(model, "sparse")
            say(f"{method}: prefill of {args.context} tokens, warm-up, {args.steps} profiled steps")
            result[method] = measure(make, model, ids, args.steps)
            write_result(path, result)
        print_table(method, result[method], args.top)


if __name__ == "__main__":
    main()

"""Where a model's teacher-forced pass over T - 1 tokens departs from its pass over T tokens, module by module.

Causal attention makes each position's result a function of the tokens up to it, so the pass over the
first T - 1 tokens of a sequence should give, at those positions, what the pass over all T gives. Where it
does not, a kernel rounds differently for another sequence length (other tiles, splits or algorithms for
another shape): `benchmarks.step_kl` sees the sum of it at the logits (`*_teacher_self_kl`), and a cached
step can come no closer to teacher forcing than teacher forcing comes to itself. This names the modules it
comes from: every submodule's output (the first tensor it returns, each call in the order the forward
finishes them, inner modules first) compared over the shared positions (a dimension one longer in the
longer pass is cut to the shorter's), with the largest absolute difference and the share of entries that
differ; `first_departure` is the first module whose output differs. The windows are `--context` + 1 tokens,
so that the shorter pass ends on a whole ASQ block at a context that is a multiple of the block (a block's
prototypes depend on every token in it, and no query reads its own block's).

    python -m benchmarks.length_stability --eval-data DATA/wikitext-2/valid.txt --result OUT.json \\
        [--export FOLDER] [--context 2048] [--rows 2] [--dtype bfloat16] [--device cuda] [--dense] [--top 20]
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.common import device_name, write_result
from benchmarks.step_kl import held_out_smollm2
from gsm_train.attention import gsm_disabled


def first_tensor(output: Any) -> Tensor | None:
    """The first tensor in a module's output (a tensor, or the first found in a tuple, list or mapping)."""
    if isinstance(output, Tensor):
        return output
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    for value in values:
        found = first_tensor(value)
        if found is not None:
            return found
    return None


def shared_part(longer: Tensor, shorter: Tensor) -> Tensor | None:
    """`longer` cut to `shorter`'s shape where a dimension is one longer (the extra position); None where the
    shapes differ otherwise (not comparable position by position)."""
    if longer.dim() != shorter.dim():
        return None
    for dim, (size, short) in enumerate(zip(longer.shape, shorter.shape, strict=True)):
        if size == short + 1:
            longer = longer.narrow(dim, 0, short)
        elif size != short:
            return None
    return longer


def difference(longer: Tensor, shorter: Tensor) -> dict[str, Any]:
    """How the longer pass's output (at the shared positions) differs from the shorter's: `max_abs_difference`
    (floats; 0.0 for other dtypes) and `mismatched`, the share of entries not bit for bit equal; or
    `comparable: False`."""
    cut = shared_part(longer, shorter)
    if cut is None:
        return {"comparable": False, "longer_shape": list(longer.shape), "shorter_shape": list(shorter.shape)}
    unequal = cut != shorter
    if cut.is_floating_point():
        both_nan = cut.isnan() & shorter.isnan()
        unequal &= ~both_nan
        largest = (cut.double() - shorter.double()).abs().masked_fill(both_nan, 0).max().item() if cut.numel() else 0.0
    else:
        largest = 0.0
    return {
        "comparable": True,
        "shape": list(shorter.shape),
        "max_abs_difference": largest,
        "mismatched": unequal.double().mean().item() if unequal.numel() else 0.0,
    }


@contextmanager
def hooked_outputs(model: nn.Module, on_output: Callable[[tuple[str, int], Tensor], None]) -> Iterator[None]:
    """Within: `on_output((name, call), tensor)` for every submodule's first output tensor, each call in the
    order the forward finishes them (`call` counts a module's calls from 0)."""
    calls: Counter = Counter()

    def hook(name: str, output: Any) -> None:
        tensor = first_tensor(output)
        if tensor is not None:
            on_output((name, calls[name]), tensor.detach())
            calls[name] += 1

    handles = [
        module.register_forward_hook(lambda _m, _a, output, name=name: hook(name, output))
        for name, module in model.named_modules()
        if name
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def length_stability(model: nn.Module, ids: Tensor) -> dict:
    """Each submodule's output of the teacher-forced pass over `ids[:, :-1]` [B, T - 1] against the pass over
    `ids` [B, T] at the shared positions; `first_departure` the first that differs (None: every output equal)
    and `logits` the model's outputs' comparison."""
    kept: dict[tuple[str, int], Tensor] = {}
    rows: list[dict] = []

    def compare(key: tuple[str, int], tensor: Tensor) -> None:
        if key in kept:
            rows.append({"module": key[0], "call": key[1], **difference(kept[key], tensor)})

    with torch.no_grad():
        with hooked_outputs(model, lambda key, tensor: kept.__setitem__(key, tensor.clone())):
            longer = model(ids, use_cache=False).logits
        with hooked_outputs(model, compare):
            shorter = model(ids[:, :-1], use_cache=False).logits
    differing = [row for row in rows if row["comparable"] and row["mismatched"] > 0]
    first = differing[0] if differing else None
    return {
        "passes": [ids.shape[1], ids.shape[1] - 1],
        "rows": ids.shape[0],
        "modules_compared": sum(row["comparable"] for row in rows),
        "modules_differing": len(differing),
        "first_departure": None if first is None else f"{first['module']} (call {first['call']})",
        "logits": difference(longer, shorter),
        "modules": rows,
    }


def print_report(result: dict, top: int) -> None:
    """The logits' difference, the first departure and the first `top` differing modules."""
    logits = result["logits"]
    print(
        f"{result['modules_differing']} of {result['modules_compared']} module outputs differ; logits: largest "
        f"difference {logits['max_abs_difference']:.3e}, {logits['mismatched']:.1%} of entries; first "
        f"departure: {result['first_departure']}"
    )
    differing = [row for row in result["modules"] if row["comparable"] and row["mismatched"] > 0]
    for row in differing[:top]:
        print(f"  {row['module']:<60} call {row['call']:<3} {row['max_abs_difference']:.3e} {row['mismatched']:8.2%}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--export", default=None, help="an export's folder (default: recipes/joint.yaml, untrained)")
    parser.add_argument("--context", type=int, default=2048, help="the shorter pass's tokens (windows are one longer)")
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dense", action="store_true", help="the base model alone (GSM switched off)")
    parser.add_argument("--top", type=int, default=20, help="differing modules printed")
    parser.add_argument("--result", required=True)
    args = parser.parse_args(argv)
    tokens = args.context + 1
    model, ids = held_out_smollm2(args.eval_data, args.export, tokens, args.rows, args.dtype, args.device)
    with gsm_disabled(model) if args.dense else nullcontext():
        result = length_stability(model, ids)
    print_report(result, args.top)
    settings = {"export": args.export, "dtype": args.dtype, "context": args.context, "dense": args.dense}
    write_result(Path(args.result), {"device": device_name(), **settings, **result})


if __name__ == "__main__":
    main()

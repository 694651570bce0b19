"""How far a cached decode step's next-token distribution is from teacher forcing's, step by step, on the
same tokens: a held-out prompt, then its real continuation fed one token per step (teacher-forced), so
both paths see the same sequence and the comparison is not thrown off by one changed token.

Per step, KL(teacher forcing || cached step) of the next-token distributions: teacher forcing is the same
model's forward over the whole sequence; the cached step is GSM's engine over its cache (prefill, then token
steps: captured CUDA graphs on CUDA) for GSM, and transformers' own cache for the dense model (GSM switched
off). GSM's cache is prefilled with `prefill="sparse"`, the teacher-forced GSM pass, so the KL measures the
cache against the same function (the default dense prefill attends as the base model and would add the two
prompt passes' difference). Exact token agreement is not a fair test in bf16 while ASQ rounds to a few bits;
the KL says how much each step's distribution moves, and `gsm_over_dense` sets GSM's against what bf16 alone
moves the dense model's.

In fp32 and bf16 GSM's KL is rounding, not a different function: the token steps' kernels round in other
orders than the teacher-forced pass, and ASQ's 2- and 4-bit codes and fp16 prototypes can turn a last-bit
difference into a code step. The prompt is not among them: it is prefilled in one pass, which gives each
query's row bit for bit as a longer pass does (`chunked_masked_attention`), and teacher forcing of T - 1
tokens against teacher forcing of T (`*_teacher_self_kl`) checks that (0 where it holds);
docs/design-decisions.md, "Cached steps and teacher forcing differ in fp32 and bf16 only by rounding".
`--dtype float64` casts GSM's modules to fp64 as well and is the exact check: the KL is 0 to fp64 rounding.

A few rows hold few code flips, so the ratio moves from one set of rows to another: `gsm_over_dense_interval`
is its 95% bootstrap interval over the rows (`ratio_interval`), each row's GSM and dense KL kept together.

    python -m benchmarks.step_kl --eval-data DATA/wikitext-2/valid.txt --result OUT.json \\
        [--export FOLDER] [--context 2048] [--steps 32] [--rows 16] [--dtype bfloat16] [--device cuda]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from torch import Tensor, nn

from benchmarks.common import write_result
from gsm_train.attention import gsm_disabled, inject_gsm, set_gsm_mode
from gsm_train.config.schema import load_recipe
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[1]


def _log_probs(logits: Tensor) -> Tensor:
    """Log-probabilities in fp32 (fp64 for an fp64 model)."""
    return torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), -1)


def teacher_log_probs(model: nn.Module, ids: Tensor, steps: int) -> Tensor:
    """Next-token log-probs [B, steps, V] after each of the last `steps` tokens of `ids` [B, T], from one
    forward over the whole sequence."""
    with torch.no_grad():
        logits = model(ids, use_cache=False, logits_to_keep=steps).logits
    return _log_probs(logits)


def cached_log_probs(model: nn.Module, ids: Tensor, steps: int, cache: object | None) -> Tensor:
    """The same from cached steps: the prompt `ids[:, :-steps]` in one forward, then each of the last `steps`
    tokens alone over `cache` (None: the model's default cache). A GSM cache's prompt goes in one pass
    however long (the generation engine's forward would feed a sparse prefill in chunks of
    `PREFILL_CHUNKS["sparse"]`, whose later chunks read the earlier ones from the cache: a prefill's
    rounding, not a step's), as the dense model's does."""
    prompt = ids.shape[1] - steps
    kwargs = cache_kwargs(model, cache) if cache is not None else {}
    prefill = model.gsm_base_forward if cache is not None else model
    parts = []
    with torch.no_grad():
        out = prefill(input_ids=ids[:, :prompt], use_cache=True, logits_to_keep=1, **kwargs)
        cache = cache if cache is not None else getattr(out, "cache", None) or out.past_key_values
        for position in range(prompt, ids.shape[1]):
            out = model(input_ids=ids[:, position : position + 1], use_cache=True, **cache_kwargs(model, cache))
            parts.append(out.logits[:, -1:])
    return _log_probs(torch.cat(parts, 1))


BOOTSTRAP_DRAWS = 2000


def kl_per_row_step(teacher: Tensor, cached: Tensor) -> Tensor:
    """KL(teacher || cached) [B, steps] from log-probs [B, steps, V]."""
    return (teacher.exp() * (teacher - cached)).sum(-1)


def kl_per_step(teacher: Tensor, cached: Tensor) -> Tensor:
    """KL(teacher || cached) [steps], the mean over rows, from log-probs [B, steps, V]."""
    return kl_per_row_step(teacher, cached).mean(0)


def ratio_interval(gsm_rows: Tensor, dense_rows: Tensor, draws: int = BOOTSTRAP_DRAWS) -> tuple[float, float] | None:
    """The 95% bootstrap interval of mean(gsm_rows) / mean(dense_rows), each row's mean KL [B] (fp64 math):
    `draws` resamplings of the rows with replacement (seeded: the same rows give the same interval), a row's
    GSM and dense KL drawn together (the same text). None where a resampling's dense mean is not above 0
    (fp64, where both are rounding around 0)."""
    picks = torch.randint(0, gsm_rows.shape[0], (draws, gsm_rows.shape[0]), generator=torch.Generator().manual_seed(0))
    gsm_means, dense_means = gsm_rows.double().cpu()[picks].mean(1), dense_rows.double().cpu()[picks].mean(1)
    if not bool((dense_means > 0).all()):
        return None
    low, high = torch.quantile(gsm_means / dense_means, torch.tensor([0.025, 0.975], dtype=torch.float64)).tolist()
    return low, high


def teacher_self_kl(model: nn.Module, ids: Tensor, teacher: Tensor) -> Tensor:
    """KL [steps - 1] of teacher forcing against itself: `teacher` (`teacher_log_probs` of `ids` [B, T])
    against the forward over the first T - 1 tokens, at the same positions. The same function computed in
    other shapes, so what rounding alone moves: the floor of the cached steps' KL."""
    steps = teacher.shape[1]
    return kl_per_step(teacher[:, :-1], teacher_log_probs(model, ids[:, :-1], steps - 1))


def step_kl(model: nn.Module, ids: Tensor, steps: int) -> dict:
    """Per-step KL of GSM's cached steps and of the dense model's (GSM off), each against its own teacher
    forcing, on `ids` [B, T] (the last `steps` tokens fed one by one); `model` carries GSM's modules. GSM's
    prompt is prefilled sparsely (module docstring), whatever prefill the model generates with. With each,
    teacher forcing's KL against itself (`teacher_self_kl`)."""
    cache = GSMCache(model, ids.shape[1], prefill="sparse")
    gsm_teacher = teacher_log_probs(model, ids, steps)
    gsm_rows = kl_per_row_step(gsm_teacher, cached_log_probs(model, ids, steps, cache))
    with gsm_disabled(model):
        dense_teacher = teacher_log_probs(model, ids, steps)
        dense_rows = kl_per_row_step(dense_teacher, cached_log_probs(model, ids, steps, None))
        dense_self = teacher_self_kl(model, ids, dense_teacher)
    gsm, dense = gsm_rows.mean(0), dense_rows.mean(0)
    gsm_mean, dense_mean = gsm.mean().item(), dense.mean().item()
    return {
        "steps": steps,
        "rows": ids.shape[0],
        "gsm_mean_kl": gsm_mean,
        "dense_mean_kl": dense_mean,
        "gsm_over_dense": gsm_mean / dense_mean if dense_mean > 0 else float("inf"),
        "gsm_over_dense_interval": ratio_interval(gsm_rows.mean(1), dense_rows.mean(1)),
        "gsm_kl_per_row": gsm_rows.mean(1).tolist(),
        "dense_kl_per_row": dense_rows.mean(1).tolist(),
        "gsm_teacher_self_kl": teacher_self_kl(model, ids, gsm_teacher).mean().item(),
        "dense_teacher_self_kl": dense_self.mean().item(),
        "gsm_kl_per_step": gsm.tolist(),
        "dense_kl_per_step": dense.tolist(),
    }


def held_out_smollm2(
    eval_data: str, export: str | None, tokens: int, rows: int, dtype: str, device: str
) -> tuple[nn.Module, Tensor]:
    """SmolLM2-135M in `dtype` on `device` with an export's GSM modules (None: recipes/joint.yaml's, untrained,
    seeded), in sparse mode, and the first `rows` windows [rows, tokens] of the held-out `eval_data` (SystemExit
    where it holds fewer). In fp64 GSM's modules, which load in fp32, are cast too, so that fp64 leaves only
    fp64 rounding."""
    model, tokenizer = load_model_and_tokenizer("smollm2-135m", dtype=getattr(torch, dtype))
    windows = pack_tokens(load_text_dataset(eval_data), tokenizer, tokens)
    if len(windows) < rows:
        raise SystemExit(f"error: --eval-data {eval_data} holds {len(windows)} windows of {tokens}")
    model.to(device).eval()
    torch.manual_seed(0)
    if export:
        load_gsm(model, export)
    else:
        inject_gsm(model, load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm, mode="sparse")
    if dtype == "float64":
        model.double()
    set_gsm_mode(model, "sparse")
    return model, windows[:rows].to(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--export", default=None, help="an export's folder (default: recipes/joint.yaml, untrained)")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float64"])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    model, ids = held_out_smollm2(args.eval_data, args.export, args.context, args.rows, args.dtype, args.device)
    enable_gsm_generation(model, prefill="sparse")
    result = step_kl(model, ids, args.steps)
    interval = result["gsm_over_dense_interval"]
    within = f" (95% over the rows: {interval[0]:.2f}-{interval[1]:.2f})" if interval is not None else ""
    print(
        f"mean KL per step: GSM {result['gsm_mean_kl']:.3e}, dense {result['dense_mean_kl']:.3e}, "
        f"GSM / dense {result['gsm_over_dense']:.2f}{within}; teacher forcing against itself (T - 1 tokens): "
        f"GSM {result['gsm_teacher_self_kl']:.3e}, dense {result['dense_teacher_self_kl']:.3e}"
    )
    write_result(Path(args.result), {"export": args.export, "dtype": args.dtype, "context": args.context, **result})


if __name__ == "__main__":
    main()

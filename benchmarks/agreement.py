"""Where cached generation and teacher forcing part ways: token agreement per dtype and per GSM part.

`model.generate` over the GSM cache (the generation engine, eager steps; on the CPU the PyTorch decode path)
against the argmax of the same model run on the whole generated sequence (teacher forcing), for
recipes/joint.yaml's modules (untrained, seeded) or an export, each part alone and together, in fp64, fp32
and bf16, beside the dense model's own agreement in the same dtype. The GSM prompt is prefilled with
`prefill="sparse"` (the teacher-forced GSM pass; the default dense prefill attends as the base model), so
both paths compute the same function (fp64 is exact), so what is left is how far each part turns last-bit
differences into other tokens: ASQ rounds residuals to a few bits and the gate keeps a top-k, both discrete
decisions.

    python -m benchmarks.agreement --eval-data DATA/wikitext-2/valid.txt --result OUT.json \\
        [--context 2048] [--new-tokens 32] [--rows 2] [--export FOLDER] [--device cpu]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from benchmarks.common import write_result
from gsm_train.attention import gsm_disabled, inject_gsm, set_gsm_mode
from gsm_train.config.schema import load_recipe
from gsm_train.data.text import load_text_dataset, pack_tokens
from gsm_train.export.save_load import load_gsm
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import load_model_and_tokenizer

REPO = Path(__file__).resolve().parents[1]
NEAR_TIE = 0.1  # a generated token within this many logits of the teacher-forced top one
# case -> recipes/joint.yaml overrides (None: the --export folder)
PARTS = {
    "gate + ASQ": [],
    "gate only": ["gsm.kv_compression.enabled=false"],
    "ASQ only": ["gsm.sparse_attention.enabled=false"],
}
CASES = [("gate + ASQ", "float64"), ("gate + ASQ", "float32"), *((part, "bfloat16") for part in PARTS)]


def agreement(model: torch.nn.Module, generated: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """The share of the last `new_tokens` of `generated` [B, T] that are the teacher-forced argmax, and the
    share that are that or within NEAR_TIE of its logit."""
    with torch.no_grad():
        logits = model(generated, use_cache=False, logits_to_keep=new_tokens + 1).logits[:, :-1].float()
    tokens = generated[:, -new_tokens:]
    gap = logits.max(-1).values - logits.gather(-1, tokens[..., None])[..., 0]
    agree = logits.argmax(-1) == tokens
    return agree.float().mean().item(), (agree | (gap <= NEAR_TIE)).float().mean().item()


def _greedy(model: torch.nn.Module, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(
            prompts, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )


def measure(part: str, dtype: str, args: argparse.Namespace, prompts: torch.Tensor) -> dict:
    """One case: the model in `dtype` with GSM `part` (or the export), GSM's and dense's agreement."""
    model, _ = load_model_and_tokenizer("smollm2-135m", dtype=getattr(torch, dtype))
    model.to(args.device).eval()
    torch.manual_seed(0)
    if args.export:
        load_gsm(model, args.export)
    else:
        inject_gsm(model, load_recipe(str(REPO / "recipes" / "joint.yaml"), PARTS[part]).gsm, mode="sparse")
    enable_gsm_generation(model, cuda_graphs=False, prefill="sparse")  # the prompt attends as teacher forcing
    set_gsm_mode(model, "sparse")
    ids = prompts.to(args.device)
    gsm, gsm_outside_ties = agreement(model, _greedy(model, ids, args.new_tokens), args.new_tokens)
    with gsm_disabled(model):
        dense, dense_outside_ties = agreement(model, _greedy(model, ids, args.new_tokens), args.new_tokens)
    return {
        "gsm": part if not args.export else f"export {args.export}",
        "dtype": dtype,
        "gsm_agreement": gsm,
        "gsm_agreement_outside_near_ties": gsm_outside_ties,
        "dense_agreement": dense,
        "dense_agreement_outside_near_ties": dense_outside_ties,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--eval-data", required=True)
    parser.add_argument("--export", default=None, help="an export's folder instead of the recipe's modules")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--result", required=True)
    args = parser.parse_args()
    _, tokenizer = load_model_and_tokenizer("smollm2-135m", dtype=torch.float32)
    windows = pack_tokens(load_text_dataset(args.eval_data), tokenizer, args.context)
    if len(windows) < args.rows:
        raise SystemExit(f"error: --eval-data {args.eval_data} holds {len(windows)} windows of {args.context}")
    prompts = windows[: args.rows, : args.context - args.new_tokens]
    cases = [("export", dtype) for dtype in ("float64", "float32", "bfloat16")] if args.export else CASES
    rows = []
    print(f"{'GSM':>12} {'dtype':>9} {'GSM':>6} {'(ties)':>7} {'dense':>6} {'(ties)':>7}")
    for part, dtype in cases:
        row = measure(part, dtype, args, prompts)
        rows.append(row)
        print(
            f"{part:>12} {dtype:>9} {row['gsm_agreement']:6.3f} {row['gsm_agreement_outside_near_ties']:7.3f} "
            f"{row['dense_agreement']:6.3f} {row['dense_agreement_outside_near_ties']:7.3f}",
            flush=True,
        )
        write_result(
            Path(args.result),
            {"context": args.context, "new_tokens": args.new_tokens, "prompt_rows": args.rows, "rows": rows},
        )


if __name__ == "__main__":
    main()

"""The passkey test (gsm_train/commands/passkey.py): seeded cases as specified, exact-match scoring, and
the scorer on tiny models (base, dense control, GSM export), teacher-forced and generating."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import Tensor, nn

from benchmarks import passkey_probe
from gsm_train.attention import inject_gsm
from gsm_train.cli import main as cli_main
from gsm_train.commands.passkey import (
    INTRO,
    NEEDLE,
    QUESTION,
    PasskeyCase,
    evaluate_passkey,
    filler_tokens,
    needle_key_positions,
    passkey_cases,
    passkey_in,
    score_passkey,
)
from gsm_train.config.schema import GSMConfig
from gsm_train.data.text import DataError
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model

LENGTH = 300  # tokens per case with the byte tokenizer: the fixed pieces take about 200


def _cases(count: int, seed: int = 0, length: int = LENGTH) -> list[PasskeyCase]:
    tokenizer = byte_tokenizer()
    pool = filler_tokens(tokenizer, "embedded:sample_prose", length)
    return passkey_cases(tokenizer, pool, length, count, seed)


def test_the_same_seed_gives_the_same_cases_and_another_seed_others() -> None:
    first, again, other = _cases(20), _cases(20), _cases(20, seed=1)
    for a, b in zip(first, again, strict=True):
        assert (a.key, a.depth, a.needle_start) == (b.key, b.depth, b.needle_start)
        assert torch.equal(a.ids, b.ids)
    assert [c.key for c in first] != [c.key for c in other]


def test_cases_hide_a_five_digit_key_at_a_uniform_depth_and_ask_for_it_at_the_end() -> None:
    tokenizer = byte_tokenizer()
    cases = _cases(2000)
    intro = len(tokenizer(INTRO).input_ids)
    for case in cases:
        assert len(case.ids) == LENGTH and case.key.isdigit() and 10000 <= int(case.key) <= 99999
        needle = tokenizer(NEEDLE.format(key=case.key)).input_ids
        room = LENGTH - intro - len(needle) - len(tokenizer(QUESTION).input_ids) - len(case.answer)
        assert case.needle_start == intro + round(case.depth * room)
        assert case.prompt[case.needle_start : case.needle_start + len(needle)].tolist() == needle
        assert tokenizer.decode(case.prompt).endswith(QUESTION)
        assert tokenizer.decode(case.answer) == f" {case.key}"
    depths = torch.tensor([case.depth for case in cases])
    assert bool(((depths >= 0) & (depths < 1)).all())
    per_decile = torch.bincount((depths * 10).long(), minlength=10)
    assert bool(((per_decile > 140) & (per_decile < 260)).all()), per_decile  # 200 each, 4.5 sd
    first_digits = torch.bincount(torch.tensor([int(c.key[0]) for c in cases]), minlength=10)
    assert first_digits[0] == 0 and bool((first_digits[1:] > 150).all())  # about 222 each
    assert {case.needle_start for case in cases} == set(range(intro, intro + room + 1))  # each


def test_a_case_too_short_for_its_pieces_or_its_filler_is_refused() -> None:
    tokenizer = byte_tokenizer()
    with pytest.raises(DataError, match="use a length above"):
        passkey_cases(tokenizer, torch.arange(1000), 150, 1, 0)
    with pytest.raises(DataError, match="give more prose"):
        passkey_cases(tokenizer, torch.arange(10), LENGTH, 1, 0)


@pytest.mark.parametrize(
    ("text", "found"),
    [
        (" 12345.", "12345"),
        ("12345 is the key", "12345"),
        (" 123456", "123456"),
        (" the key", None),
        ("\nkey 1234", "1234"),
    ],
)
def test_the_first_digits_of_a_continuation_are_its_answer(text: str, found: str | None) -> None:
    assert passkey_in(text) == found


class ScriptedLM(nn.Module):
    """A hand-made language model: at every position its logits put the most weight on the token
    `script` holds for the next position, so its greedy answer is the script's."""

    def __init__(self, script: Tensor, vocab: int = 257) -> None:
        super().__init__()
        self.script, self.vocab = script, vocab
        self.anchor = nn.Parameter(torch.zeros(1))  # gives the scorer a device

    def forward(
        self, input_ids: Tensor, use_cache: bool = False, logits_to_keep: int = 0, **_: object
    ) -> SimpleNamespace:
        logits = torch.nn.functional.one_hot(self.script[1:], self.vocab).float()
        logits = torch.cat((logits, torch.zeros(1, self.vocab)))[None]
        logits = logits.expand(len(input_ids), -1, -1)
        return SimpleNamespace(logits=logits[:, -logits_to_keep:] if logits_to_keep else logits)


def test_teacher_forced_scoring_is_exact_match_of_every_answer_token() -> None:
    case = _cases(1)[0]
    tokenizer = byte_tokenizer()
    right = score_passkey(ScriptedLM(case.ids), tokenizer, [case])
    assert right["accuracy"] == 1.0 and right["per_case"][0]["answer_token_accuracy"] == 1.0
    for wrong_at in (0, len(case.answer) - 1):  # the first and the last answer token
        script = case.ids.clone()
        script[len(case.prompt) + wrong_at] = (script[len(case.prompt) + wrong_at] + 1) % 256
        wrong = score_passkey(ScriptedLM(script), tokenizer, [case])["per_case"][0]
        assert not wrong["retrieved"]
        assert wrong["answer_token_accuracy"] == pytest.approx(1 - 1 / len(case.answer))
    shifted = torch.cat((case.ids[:1], case.ids[:-1]))  # the script one position late
    assert score_passkey(ScriptedLM(shifted), tokenizer, [case])["accuracy"] == 0.0


def _export(tmp_path: Path, name: str, gsm: dict) -> str:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(gsm))
    return str(export_adapter(model, tmp_path / name, base_name="tiny-llama"))


def test_the_scorer_runs_base_control_and_gsm_through_teacher_forcing_and_the_cache(tmp_path: Path) -> None:
    exports = {
        "dense_control": _export(tmp_path, "control", {"gsm_enabled": False}),
        "gsm": _export(tmp_path, "gsm", {"sparse_attention": {"top_k": 8, "k_min": 8}}),
    }
    report = evaluate_passkey("tiny-llama", exports, "embedded:sample_prose", LENGTH, 4, 0, batch_size=2, generate=True)
    assert set(report["results"]) == {"base", "dense_control", "gsm"}
    for result in report["results"].values():
        assert result["cases"] == 4 and sum(q["cases"] for q in result["by_depth"]) == 4
        for case in result["per_case"]:
            # greedy decoding writes the answer tokens exactly when teacher forcing argmaxes them
            assert case["retrieved"] <= case["generated_retrieved"]
            assert case["answer_nll"] > 0
    # the dense control holds the base's weights unchanged: the same scores
    assert report["results"]["dense_control"]["per_case"] == report["results"]["base"]["per_case"]


def test_cli_writes_json_and_table(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    argv = ["passkey", "--model", "tiny-llama", "--length", str(LENGTH), "--cases", "2", "--out", str(tmp_path / "pk")]
    assert cli_main(argv) == 0
    assert "| base |" in capsys.readouterr().out
    report = json.loads((tmp_path / "pk" / "passkey.json").read_text())
    assert report["results"]["base"]["cases"] == 2
    assert cli_main([*argv[:-2], "--length", "20", "--out", str(tmp_path / "short")]) == 2
    assert "use a length above" in capsys.readouterr().err


def test_cli_runs_exports_on_the_oracle_s_selection_and_a_selection_given(tmp_path: Path) -> None:
    """`--mode oracle` and `--select` reach the exports: with every key kept (k = the case's
    length), the gate's and the oracle's selections are the same set, so the scores are equal;
    with 8 keys they are not."""
    export = _export(tmp_path, "gsm", {"sparse_attention": {"top_k": 8, "k_min": 8}})

    def scores(mode: str, k: int) -> list[dict]:
        out = tmp_path / f"{mode}_{k}"
        argv = ["passkey", "--export", f"gsm={export}", "--length", str(LENGTH), "--cases", "2", "--mode", mode]
        assert cli_main([*argv, "--select", f"top_k={k}", "--select", f"k_min={k}", "--out", str(out)]) == 0
        report = json.loads((out / "passkey.json").read_text())
        assert report["mode"] == mode and report["selection"] == {"top_k": k, "k_min": k}
        return report["results"]["gsm"]["per_case"]

    assert scores("oracle", LENGTH) == scores("sparse", LENGTH)
    assert scores("oracle", 8) != scores("sparse", 8)


def test_the_needle_key_positions_are_the_digits_of_both_mentions_of_the_key() -> None:
    tokenizer = byte_tokenizer()
    for case in _cases(50):
        positions = needle_key_positions(tokenizer, case)
        assert len(positions) == 10 and tokenizer.decode(case.prompt[positions]) == case.key * 2


def test_the_needle_probe_measures_each_gate_layer_against_the_dense_attention(tmp_path: Path) -> None:
    """benchmarks/passkey_probe.py on a tiny export: the needle's mass is the base's attention there (eager
    attention weights, computed apart), the oracle captures at least the gate's mass, and with every key
    kept both selections keep everything."""
    sparse = {"top_k": 8, "k_min": 8, "dense_layers": [0], "sink_tokens": 1, "recent_tokens": 4}
    export = _export(tmp_path, "gsm", {"sparse_attention": sparse})

    def probe(*more: str) -> dict:
        argv = ["--export", export, "--length", str(LENGTH), "--cases", "2", "--result", str(tmp_path / "p.json")]
        return passkey_probe.main([*argv, *more])

    result = probe("--plot", str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 1000
    assert json.loads((tmp_path / "p.json").read_text())["layers"].keys() == {"1", "2", "3"}
    base = tiny_model("llama")
    base.set_attn_implementation("eager")
    tokenizer = byte_tokenizer()
    needle = {name: 0.0 for name in ("1", "2", "3")}
    for case in _cases(2):
        rows, digits = passkey_probe.answer_queries(case), needle_key_positions(tokenizer, case)
        with torch.no_grad():
            weights = base(case.ids[None], output_attentions=True).attentions
        for name in needle:
            needle[name] += float(weights[int(name)][0][:, rows][..., digits].sum(-1).mean()) / 2
    for layer, figures in result["layers"].items():
        assert figures["needle_mass"] == pytest.approx(needle[str(layer)], rel=1e-4, abs=1e-7)
        assert figures["gate_mass"] <= figures["oracle_mass"] + 1e-6
        assert 0 <= figures["gate_needle_mass"] <= figures["needle_mass"] + 1e-6
        assert figures["needle_mass_top_head"] >= figures["needle_mass"] - 1e-6
        assert 0 <= figures["gate_kept"] <= 1 and 0 <= figures["oracle_kept"] <= 1
        assert figures["needle_mass_lost"] == figures["oracle_needle_mass"] - figures["gate_needle_mass"]
    every_key = probe("--select", f"top_k={LENGTH}", "--select", f"k_min={LENGTH}")
    for figures in every_key["layers"].values():
        assert figures["gate_kept"] == figures["oracle_kept"] == 1.0 and figures["needle_mass_lost"] == 0.0
        assert figures["gate_mass"] == figures["oracle_mass"] == pytest.approx(1.0)

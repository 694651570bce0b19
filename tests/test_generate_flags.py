"""`gsm-train generate`'s sampling flags (--temperature, --top-p, --top-k, --seed) and --chat."""

from __future__ import annotations

from pathlib import Path

import pytest

from gsm_train import cli
from gsm_train.attention import inject_gsm
from gsm_train.commands.generate import Sampling, prompt_ids
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter
from gsm_train.models import model_zoo

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}" + (
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = model_zoo.tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {"top_k": 8, "k_min": 8}}))
    return export_adapter(model, tmp_path_factory.mktemp("gen") / "export", base_name="tiny-llama")


def _generated(export: Path, capsys: pytest.CaptureFixture[str], *flags: str) -> str:
    argv = ["generate", "--adapter", str(export), "--prompt", "Once upon", "--max-new-tokens", "24", *flags]
    assert cli.main(argv) == 0
    return capsys.readouterr().out


def test_sampling_flags_choose_sampling_and_a_seed_repeats_it(export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert Sampling().generate_kwargs() == {"do_sample": False}
    assert Sampling(temperature=0.7, top_k=5, seed=1).generate_kwargs() == {
        "do_sample": True,
        "temperature": 0.7,
        "top_k": 5,
    }
    greedy = _generated(export, capsys)
    assert _generated(export, capsys, "--seed", "3") == greedy  # a seed alone stays greedy
    sampled = [_generated(export, capsys, "--temperature", "5", "--top-p", "1", "--seed", str(s)) for s in (1, 1, 2)]
    assert sampled[0] == sampled[1]  # the same seed, the same text
    assert sampled[0] != sampled[2] and greedy not in sampled  # 24 tokens at temperature 5: the draws differ


@pytest.mark.parametrize(
    "flag", [["--temperature", "0"], ["--top-p", "1.5"], ["--top-k", "0"], ["--temperature", "nan"]]
)
def test_bad_sampling_values_are_refused_by_the_parser(flag: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["generate", "--model", "tiny-llama", "--prompt", "x", *flag])
    assert done.value.code == 2 and f"argument {flag[0]}" in capsys.readouterr().err


def test_chat_applies_the_template_and_is_refused_without_one(export: Path, capsys: pytest.CaptureFixture[str]) -> None:
    tokenizer = model_zoo.byte_tokenizer()
    assert tokenizer.decode(prompt_ids(tokenizer, "Hi", chat=False)[0]) == "Hi"
    assert cli.main(["generate", "--adapter", str(export), "--prompt", "Hi", "--chat"]) == 2
    assert "the tokenizer has no chat template. Fix: drop --chat" in capsys.readouterr().err
    tokenizer.chat_template = TEMPLATE
    assert tokenizer.decode(prompt_ids(tokenizer, "Hi", chat=True)[0]) == "<user>Hi<eos><assistant>"

"""The CLI around exports: --version, `generate` and `eval` taking the base from the export, and
prompts refused (exit 2) before any model loads."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gsm_train import __version__, cli
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.export.save_load import export_adapter
from gsm_train.models.model_zoo import tiny_model

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def export(tmp_path: Path) -> Path:
    """An export trained on tiny-qwen2: a base no command defaults to."""
    model = tiny_model("qwen2")
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": {"top_k": 8, "k_min": 8}}))
    return export_adapter(model, tmp_path / "export", base_name="tiny-qwen2")


def test_version_is_the_packages(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    declared = re.search(r'^version = "([^"]+)"$', (REPO / "pyproject.toml").read_text(), re.M)[1]
    assert done.value.code == 0 and capsys.readouterr().out == f"gsm-train {declared}\n" == f"gsm-train {__version__}\n"


def test_generate_and_eval_take_the_base_from_the_export(
    export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for prefill in ("dense", "sparse"):  # how the prompt attends
        command = [
            "generate",
            "--adapter",
            str(export),
            "--prompt",
            "Once",
            "--max-new-tokens",
            "3",
            "--prefill",
            prefill,
        ]
        assert cli.main(command) == 0
        assert "3 tokens" in capsys.readouterr().err
    argv = [
        "eval",
        "--data",
        "embedded:sample_prose",
        "--export",
        f"gsm={export}",
        "--seq-len",
        "32",
        "--windows",
        "2",
        "--min-keys",
        "8",
        "--out",
        str(tmp_path / "eval"),
    ]
    assert cli.main(argv) == 0
    assert '"model": "tiny-qwen2"' in (tmp_path / "eval" / "eval.json").read_text()
    # told otherwise, the base is checked against the export's
    assert cli.main([*argv, "--model", "tiny-llama"]) == 2
    assert "trained on 'tiny-qwen2', which differs from this model" in capsys.readouterr().err


def test_generate_fused_decode_reaches_the_generation_engine(
    export: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`generate --fused-decode` loads the export with the fused token steps switched on (they run on a GPU with
    Triton; here the modules' own forwards serve), without it off, and both generate."""
    from gsm_train.export import pretrained

    options = []

    def recording(model: object, **kwargs: object) -> None:
        options.append(kwargs["fused_decode"])
        enable(model, **kwargs)

    enable = pretrained.enable_gsm_generation
    monkeypatch.setattr(pretrained, "enable_gsm_generation", recording)
    command = ["generate", "--adapter", str(export), "--prompt", "Once", "--max-new-tokens", "3"]
    assert cli.main([*command, "--fused-decode"]) == 0 and cli.main(command) == 0
    assert options == [True, False]
    assert capsys.readouterr().err.count("3 tokens") == 2


def test_generate_without_a_model_or_adapter_says_what_to_give(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["generate", "--prompt", "Once"]) == 2
    assert "give --adapter" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("prompt", "content", "message"),
    [
        ("", None, "--prompt: the prompt is empty"),
        (" \n\t", None, "--prompt: the prompt is empty"),
        (None, b"", "the prompt is empty"),
        (None, b"caf\xe9 au lait", "not UTF-8 text (invalid continuation byte at byte 3)"),
    ],
)
def test_a_bad_prompt_is_refused_before_the_model_loads(
    export: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    prompt: str | None,
    content: bytes | None,
    message: str,
) -> None:
    monkeypatch.setattr(
        cli,
        "generate",
        lambda *a, **k: pytest.fail("the model loaded before the prompt was checked"),
    )
    if prompt is None:
        (tmp_path / "prompt.txt").write_bytes(content)
        source = ["--prompt-file", str(tmp_path / "prompt.txt")]
    else:
        source = ["--prompt", prompt]
    assert cli.main(["generate", "--adapter", str(export), *source]) == 2
    err = capsys.readouterr().err
    assert message in err and "Fix: " in err and "Traceback" not in err

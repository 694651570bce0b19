"""benchmarks.int4_groups on the CPU: a 4-bit layer read back into float32 multiplies as the 4-bit one does, a
base whose weights are already 4-bit in runs of 32 (SmolLM2's Q4_1 GGUF) comes back from groups of 32 and not
from groups of 64, and the benchmark's table and JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from benchmarks import int4_groups
from benchmarks.int4_groups import expand_to_float
from gsm_train.export.int4 import quantize_base
from gsm_train.models.model_zoo import tiny_model

pytest.importorskip("torchao", reason="the int4 path needs torchao (pip install 'gsm-train[int4]')")


def _linears(model: nn.Module) -> dict[str, nn.Linear]:
    head = model.get_output_embeddings()
    return {name: m for name, m in model.named_modules() if type(m) is nn.Linear and m is not head}


@torch.no_grad()
def _on_q4_1_grid(model: nn.Module) -> None:
    """Every base linear's weights put on Q4_1's grid: each run of 32 inputs of a row from its min (code 0) to
    its max (code 15) in 15 equal steps."""
    for linear in _linears(model).values():
        runs = linear.weight.view(linear.out_features, -1, 32)
        low, high = runs.amin(-1, keepdim=True), runs.amax(-1, keepdim=True)
        step = (high - low) / 15
        linear.weight.copy_((torch.round((runs - low) / step).clamp(0, 15) * step + low).view_as(linear.weight))


def test_a_layer_read_back_multiplies_as_its_4bit_kernel() -> None:
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=1)
    names = quantize_base(model, 32)
    modules = dict(model.named_modules())
    inputs = {name: torch.randn(5, modules[name].in_features) for name in names}
    four_bit = {name: modules[name](inputs[name]) for name in names}
    expand_to_float(model, names)
    for name in names:
        assert type(modules[name].weight.data) is torch.Tensor and modules[name].weight.dtype == torch.float32
        torch.testing.assert_close(modules[name](inputs[name]), four_bit[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("group", [32, 64])
def test_weights_already_4bit_in_runs_of_32_come_back_from_groups_of_32_only(group: int) -> None:
    torch.manual_seed(0)
    model = tiny_model("llama", num_layers=1)
    _on_q4_1_grid(model)
    before = {name: linear.weight.clone() for name, linear in _linears(model).items()}
    names = quantize_base(model, group)
    expand_to_float(model, names)
    after = _linears(model)
    errors = [(after[name].weight - before[name]).abs().max() / before[name].abs().max() for name in names]
    if group == 32:  # the same grid: back to fp32's last bit
        assert max(errors) < 1e-6
    else:  # one grid over two runs of 32: most weights move to another value
        assert min(errors) > 1e-3


def test_the_benchmark_writes_each_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "valid.txt"
    text.write_text("a held-out line of text, repeated for the windows. " * 40)
    result = tmp_path / "groups.json"
    args = ["--model", "tiny-llama-1", "--eval-data", str(text), "--result", str(result)]
    int4_groups.main([*args, "--seq-len", "64", "--windows", "2", "--first-window", "1"])
    written = json.loads(result.read_text())
    assert written["settings"]["first_window"] == 1 and written["settings"]["windows"] == 2
    assert set(written["groups"]) == {"32", "64"}
    for figures in written["groups"].values():
        assert figures["over_full"] == figures["ppl"] / written["ppl_full"] and figures["layers"] == 7
    assert "| int4, groups of 64 |" in capsys.readouterr().out


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(SystemExit):
        int4_groups.parse_args(["--eval-data", "x", "--result", "y", "--groups", "48"])
    with pytest.raises(SystemExit):
        int4_groups.parse_args(["--eval-data", "x", "--result", "y", "--windows", "1"])

"""benchmarks/scale_8b.py: its rows run on the CPU with a tiny model (smoke test), its result file
is resumable, its FLOPs formula gives the stated counts for Llama-3-8B's shapes, and
`random-llama3-8b` is built where and in what dtype it is asked, with Llama-3-8B's parameter count.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from run_helpers import GATE_RECIPE

from benchmarks import scale_8b
from gsm_train.config.schema import load_recipe
from gsm_train.models.model_zoo import random_model, read_model_config

TINY = [
    "--model",
    "tiny-llama",
    "--seq-len",
    "64",
    "--steps",
    "1",
    "--set",
    "gsm.sparse_attention.top_k=8",
    "gsm.sparse_attention.k_min=8",
    "logging.recall_min_keys=16",
    "gsm.kv_compression.layer_bits={}",
    "gsm.kv_compression.block_size=16",
]


def test_every_row_runs_on_a_tiny_model_and_a_second_run_resumes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    result = tmp_path / "scale.json"
    scale_8b.main(["--result", str(result), *TINY])
    written = json.loads(result.read_text())
    assert {"command", "commit", "device", "settings", "summary", "rows"} <= written.keys()
    assert list(written["rows"]) == list(scale_8b.ROWS)
    for name, row in written["rows"].items():
        assert row["step_ms"] > 0 and row["tokens_per_s"] > 0 and row["trainable_params"] > 0, name
        assert row["activation_checkpointing"] == (name != "gate_warmup")
        # every row's checkpoint resumes, in a stage set up again, to the same next-step loss (CPU: exact)
        assert row["checkpoint_bytes"] > 0 and row["checkpoint_s"] > 0 and row["resume_s"] > 0, name
        assert row["resumed_next_step_loss"] == row["next_step_loss"], name
    gate = written["rows"]["gate_warmup"]
    assert gate["forward_ms"] > 0
    assert written["summary"]["joint_full_resumed_loss_abs_diff"] == 0
    assert written["rows"]["joint_full"]["optimizer_state_dtype"] == "bf16"
    assert written["summary"]["stage1_step_over_forward"] == gate["step_over_forward"]
    capsys.readouterr()
    scale_8b.main(["--result", str(result), *TINY, "--redo", "dense_lora"])
    out = capsys.readouterr().out
    assert out.count("measured already") == 4 and "dense_lora: measuring" in out
    again = json.loads(result.read_text())["rows"]
    assert again["gate_warmup"] == written["rows"]["gate_warmup"]
    assert again["dense_lora"] != written["rows"]["dense_lora"]


def test_model_flops_of_llama3_8b_shapes() -> None:
    config = read_model_config("random-llama3-8b")
    matmul_params = 32 * (4096 * 128 * (2 * 32 + 2 * 8) + 3 * 4096 * 14336) + 4096 * 128256
    attention = 4 * 32 * 32 * 128 * 8192
    assert matmul_params == 7_504_658_432
    assert scale_8b.model_flops_per_token(config, 8192, "full") == 6 * matmul_params + 3 * attention
    assert scale_8b.model_flops_per_token(config, 8192, "lora") == 4 * matmul_params + 3 * attention
    assert scale_8b.model_flops_per_token(config, 8192, "forward") == 2 * matmul_params + attention


def test_random_llama3_8b_is_built_on_the_device_in_the_dtype_asked() -> None:
    model = random_model("random-llama3-8b", torch.bfloat16, "meta")  # the meta device holds no memory
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 8_030_261_248
    assert {p.device.type for p in params} == {"meta"} and {p.dtype for p in params} == {torch.bfloat16}
    assert load_recipe(GATE_RECIPE, ["model.name_or_path=random-llama3-8b"]).model.name_or_path == "random-llama3-8b"


@pytest.mark.gpu_training  # on a GPU machine the row trains there, so its kernels' figures are checked
def test_a_checkpoint_the_scratch_disk_cannot_hold_is_refused_and_a_row_can_be_profiled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With 1 kB free the row keeps its step figures, says what the checkpoint needs, writes nothing; with
    --profile-steps its largest ops (CPU) come with it."""
    monkeypatch.setattr(scale_8b.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    result = tmp_path / "scale.json"
    scale_8b.main(
        ["--result", str(result), *TINY, "--only", "dense_lora", "--profile-steps", "1", "--scratch", str(tmp_path)]
    )
    row = json.loads(result.read_text())["rows"]["dense_lora"]
    assert row["step_ms"] > 0 and "checkpoint_bytes" not in row and "resume_s" not in row
    assert "GB free" in row["checkpoint_error"] and "--scratch" in row["checkpoint_error"]
    assert [p.name for p in tmp_path.iterdir()] == ["scale.json"]
    assert 0 < len(row["kernels"]) <= scale_8b.PROFILE_TOP
    assert all(k["total_us"] > 0 and k["calls"] > 0 for k in row["kernels"])
    if torch.cuda.is_available():  # every kernel's time of a step, of which the table keeps the largest
        assert row["kernel_ms"] >= sum(k["total_us"] for k in row["kernels"]) / 1e3 * (1 - 1e-9) > 0
        assert row["gpu_busy"] > 0
    else:
        assert "kernel_ms" not in row and "gpu_busy" not in row

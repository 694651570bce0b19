"""benchmarks.decode_step_profile on the CPU with the tiny model: a per-op table for the dense engine's and
GSM's token steps, written as JSON, and a second run with the same settings profiles nothing again."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from run_helpers import KERNEL_DEVICE, triton_kernel_test

from benchmarks import decode_step_profile


def test_profile_writes_a_table_per_method_and_resumes(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    path = tmp_path / "profile.json"
    argv = ["--model", "tiny", "--context", "37", "--steps", "2", "--result", str(path)]
    decode_step_profile.main(argv)
    result = json.loads(path.read_text())
    # the block kernel is named either way: profiles from before it was the default lack it and run again
    assert result["settings"] == {"model": "tiny", "context": 37, "batch": 1, "steps": 2, "dense_block_kernel": True}
    for method in ("dense_engine", "gsm"):
        kernels = result[method]["kernels"]
        assert result[method]["step_us"] > 0 and {"name", "calls", "total_us", "share"} <= set(kernels[0])
        assert sum(row["share"] for row in kernels) == pytest.approx(1.0)
        assert [row["total_us"] for row in kernels] == sorted((row["total_us"] for row in kernels), reverse=True)
    assert any("topk" in row["name"] for row in result["gsm"]["kernels"])  # GSM's step selects its keys
    assert "dense_engine:" in capsys.readouterr().out
    decode_step_profile.main(argv)
    assert capsys.readouterr().out.count("profiled by an earlier run") == 2
    assert json.loads(path.read_text())["gsm"] == result["gsm"]


def test_every_key_profiles_gsm_in_dense_mode_without_a_selection(tmp_path: Path) -> None:
    path = tmp_path / "profile.json"
    decode_step_profile.main(
        ["--model", "tiny", "--context", "37", "--steps", "2", "--every-key", "--result", str(path)]
    )
    result = json.loads(path.read_text())
    assert result["settings"]["every_key"] and {"dense_engine", "gsm", "gsm_every_key"} <= set(result)
    assert any("topk" in row["name"] for row in result["gsm"]["kernels"])
    assert not any("topk" in row["name"] for row in result["gsm_every_key"]["kernels"])  # no keys selected


# The most aten ops (views aside) one decoder layer of GSM's token step runs, counted by
# `decode_step_profile --count` on the tiny Llama at recipes/joint.yaml's settings (layers 0 and 1 dense,
# 2 and 3 sparse), on the PyTorch path and on the fused kernels' path (docs/results.md, "GSM's token step:
# ops per layer (CPU count)"). A sparse layer's first count includes the schedule's k, computed once a step,
# and on the fused path the gate-token kernel's split scratch (an allocation, not a kernel).
MOST_OPS_PYTORCH_PATH = {"dense": 103, "sparse": 160}
MOST_OPS_FUSED_PATH = {"dense": 49, "sparse": 56}
HOST_SYNC = "aten._local_scalar_dense.default"


def _counted_step(tmp_path: Path, device: str) -> dict:
    path = tmp_path / "count.json"
    decode_step_profile.main(
        ["--model", "tiny", "--context", "40", "--count", "--device", device, "--result", str(path)]
    )
    return json.loads(path.read_text())


def _assert_at_most(gsm: dict, most: dict[str, int]) -> None:
    dense, sparse = gsm["per_layer"][:2], gsm["per_layer"][2:]
    assert max(dense) <= most["dense"] and max(sparse) <= most["sparse"], gsm["per_layer"]
    assert sum(layer.get(HOST_SYNC, 0) for layer in gsm["ops"]) <= 1  # the step's k, read once, not per layer


def test_gsm_token_step_runs_at_most_so_many_ops_per_layer_on_the_pytorch_path(tmp_path: Path) -> None:
    result = _counted_step(tmp_path, "cpu")
    assert result["settings"]["count"] and len(result["dense_engine"]["per_layer"]) == 4
    _assert_at_most(result["gsm"], MOST_OPS_PYTORCH_PATH)


def test_smollm2_s_shapes_take_the_8k_recipe_s_layers(tmp_path: Path) -> None:
    """`--model smollm2` counts SmolLM2's 30 layers with recipes/joint_long.yaml's modules: layers 0 and 1
    dense, the retrieval layers 7 and 18 reading every key (no selection: fewer ops than the other sparse
    layers)."""
    path = tmp_path / "smollm2.json"
    decode_step_profile.main(
        ["--model", "smollm2", "--context", "300", "--count", "--device", "cpu", "--result", str(path)]
    )
    per_layer = json.loads(path.read_text())["gsm"]["per_layer"]
    selecting = [count for layer, count in enumerate(per_layer) if layer not in (0, 1, 7, 18)]
    assert len(per_layer) == 30 and max(per_layer[:2]) < min(selecting)
    assert per_layer[7] == per_layer[18] < min(selecting)


@triton_kernel_test
def test_gsm_token_step_runs_at_most_so_many_ops_per_layer_on_the_fused_path(tmp_path: Path) -> None:
    """The glue around the fused kernels (on a GPU, or on the CPU under Triton's interpreter): a sparse
    layer runs about what a layer of the dense engine does, plus the kernels (counted once each)."""
    _assert_at_most(_counted_step(tmp_path, KERNEL_DEVICE)["gsm"], MOST_OPS_FUSED_PATH)


# The most ops one `GSMCache.pack_full_tail` runs per decoder layer when it packs (eagerly: the CPU, or a
# step that is not captured; a GPU replays them from one graph), counted by `decode_step_profile
# --count-outside` on the tiny Llama at recipes/joint.yaml's settings: K and V encoded as one and written by
# device index (docs/design-decisions.md, "Packing a full block: one captured graph"; 112.5 before, K and V
# packed apart). Plus at most 4 a pack whatever the layers: the block's positions, and the lengths advanced.
MOST_PACK_OPS_PER_LAYER = 88
# The most ops `model.generate`'s greedy loop (`inference.greedy_loop`) runs per token outside the token step,
# as benchmarks.generate calls it (EOS set, barred by min_new_tokens, the caller's cache): the argmax, EOS
# barred (index_fill), finished rows padded (where, isin, logical_and_), and the host's check that a row is
# unfinished (any, item: every token, since the caller keeps the cache; every 8th where the call made it).
MOST_GREEDY_LOOP_OPS = 7


def test_what_gsm_runs_outside_its_token_step_is_counted_per_token_and_per_pack(tmp_path: Path) -> None:
    path = tmp_path / "outside.json"
    decode_step_profile.main(
        ["--model", "tiny", "--context", "40", "--count-outside", "--device", "cpu", "--result", str(path)]
    )
    result = json.loads(path.read_text())
    assert result["settings"]["count_outside"]
    loops = result["gsm_outside"]
    assert loops["plain_loop"]["per_token"] == 1  # the argmax: the loop's only op besides the step's
    # GSM's greedy loop behind `model.generate` against transformers' loop over the same cache (34 ops)
    assert loops["generate"]["per_token"] <= MOST_GREEDY_LOOP_OPS < loops["transformers_loop"]["per_token"]
    for counts in loops.values():
        assert counts["per_pack"] <= 4 * MOST_PACK_OPS_PER_LAYER + 4
        assert counts["step"] > counts["per_token"]

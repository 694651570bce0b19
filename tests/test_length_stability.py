"""benchmarks.length_stability: GSM's teacher-forced pass on the CPU gives each position what a pass one token
longer gives (every module's output bit for bit), and the comparison names the first module whose output
depends on the sequence's length."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from benchmarks.length_stability import difference, length_stability, shared_part
from gsm_train.attention import inject_gsm
from gsm_train.config.schema import GSMConfig
from gsm_train.models.model_zoo import tiny_model

SPARSE = {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"}
ASQ = {"enabled": True, "block_size": 8, "cluster_num": 2, "hidden_dim": 8}


def _gsm_model() -> nn.Module:
    model = tiny_model("llama")
    torch.manual_seed(1)
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": SPARSE, "kv_compression": ASQ}), mode="sparse")
    return model.eval()


def _ids() -> Tensor:
    return torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))  # the shorter pass: 4 blocks


def test_gsm_teacher_forcing_on_the_cpu_gives_every_module_the_same_output_one_token_shorter() -> None:
    result = length_stability(_gsm_model(), _ids())
    assert result["passes"] == [33, 32] and result["first_departure"] is None
    assert result["modules_compared"] > 20 and result["modules_differing"] == 0
    assert result["logits"]["mismatched"] == 0 and result["logits"]["max_abs_difference"] == 0
    assert any(".gsm." in row["module"] for row in result["modules"])  # GSM's own modules are among them


def test_the_first_module_whose_output_depends_on_the_length_is_named() -> None:
    model = _gsm_model()
    mlp = model.model.layers[1].mlp
    plain = mlp.forward
    mlp.forward = lambda x: plain(x) + x.mean(1, keepdim=True)  # every position sees the whole sequence
    result = length_stability(model, _ids())
    assert result["first_departure"] == "model.layers.1.mlp (call 0)"
    assert result["logits"]["max_abs_difference"] > 0
    names = [row["module"] for row in result["modules"] if row["mismatched"] > 0]
    assert "model.layers.0.mlp" not in names and "model.layers.1.mlp.down_proj" not in names


def test_outputs_are_compared_at_the_shared_positions_only() -> None:
    longer, shorter = torch.arange(12.0).view(1, 3, 4), torch.arange(12.0).view(1, 3, 4)[:, :2]
    assert torch.equal(shared_part(longer, shorter), shorter)
    assert shared_part(torch.zeros(2, 5), torch.zeros(2, 3)) is None  # not one position longer
    assert difference(torch.zeros(2, 5), torch.zeros(2, 3)) == {
        "comparable": False,
        "longer_shape": [2, 5],
        "shorter_shape": [2, 3],
    }
    changed = shorter.clone()
    changed[0, 1, 2] += 0.5
    assert difference(longer, changed) == {
        "comparable": True,
        "shape": [1, 2, 4],
        "max_abs_difference": 0.5,
        "mismatched": 1 / 8,
    }

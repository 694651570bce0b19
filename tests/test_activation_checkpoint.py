"""Activation checkpointing per decoder layer or per layer's MLP: the joint stage's loss, terms and
gradients equal those of the same step without it (exactly, in fp32 on the CPU), a recomputation in
the backward records nothing into the forward's GSM records, and the MLP scope runs only the MLPs again."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from run_helpers import TINY_LLAMA_64
from torch import nn

from gsm_train.attention import gsm_collect
from gsm_train.config.schema import load_recipe
from gsm_train.models.families import decoder_layers
from gsm_train.models.model_zoo import tiny_model
from gsm_train.training.activation_checkpoint import checkpoint_decoder_layers
from gsm_train.training.stages import JointStage

REPO = Path(__file__).resolve().parents[1]
# the joint stage with every GSM module training: sparse attention on the gate's top-k, ASQ on K/V,
# the bridge from layer 1 into layers 2-3, the gate's KL on sampled query rows; the base trains too
ALL_ON = [
    *TINY_LLAMA_64,
    "init_from=null",
    "logging.recall_min_keys=16",
    "gsm.sparse_attention.top_k=8",
    "gsm.sparse_attention.k_min=8",
    "gsm.sparse_attention.dense_layers=[0]",
    "gsm.kv_compression.block_size=16",
    "gsm.kv_compression.layer_bits={}",
    "gsm.cross_layer_sharing.enabled=true",
    "gsm.cross_layer_sharing.bridge_from=1",
    "gsm.cross_layer_sharing.bridge_to_start=2",
    "train.distill_queries=16",
    "train.base=full",
]


def _joint_model(scope: str | None) -> tuple[nn.Module, JointStage]:
    """The tiny joint model, its decoder layers checkpointed in `scope` ("layer", "mlp"; None: not)."""
    config = load_recipe(str(REPO / "recipes" / "joint.yaml"), ALL_ON)
    model = tiny_model("llama")
    stage = JointStage()
    torch.manual_seed(0)
    stage.prepare(model, config)
    if scope is not None:
        assert checkpoint_decoder_layers(model, scope) == 4
    return model.train(), stage


def _step(scope: str | None, batch: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss and terms, gradients by name) of one joint micro-step."""
    model, stage = _joint_model(scope)
    torch.manual_seed(1)  # the KL's query rows are drawn in the forward
    loss, terms = stage.loss(model, batch)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return {"loss": loss.detach(), **terms}, grads


@pytest.mark.parametrize("scope", ["layer", "mlp"])
def test_checkpointed_layers_give_the_same_loss_and_gradients(scope: str) -> None:
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    plain_terms, plain_grads = _step(None, batch)
    ckpt_terms, ckpt_grads = _step(scope, batch)
    assert set(plain_terms) == {"loss", "lm_loss", "gate_kl", "asq_loss"} == set(ckpt_terms)
    for name, value in plain_terms.items():
        assert torch.equal(ckpt_terms[name], value), name  # the forward is the same computation
    assert plain_grads.keys() == ckpt_grads.keys()
    assert any(".gsm.gate." in n for n in plain_grads) and any(".gsm.bridge." in n for n in plain_grads)
    for (
        name,
        grad,
    ) in plain_grads.items():  # the recomputation repeats the forward's fp32 operations exactly
        assert torch.equal(ckpt_grads[name], grad), name


def test_a_recomputation_records_nothing() -> None:
    model, _ = _joint_model("layer")
    batch = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(4))
    with gsm_collect(model, distill=True, distill_on_selection=True, distill_queries=16) as records:
        loss = model(input_ids=batch, labels=batch, use_cache=False).loss
    before = {layer: (r.gate_kl, r.asq_loss) for layer, r in records.layers.items()}
    assert sum(r.gate_kl is not None for r in records.layers.values()) == 3  # layers 1-3 (layer 0 dense)
    total = loss + sum(records.gate_kl_means()) + sum(records.asq_losses())
    total.backward()  # recomputes each layer
    after = {layer: (r.gate_kl, r.asq_loss) for layer, r in records.layers.items()}
    assert after.keys() == before.keys() and records.forwards == 1
    for layer, (kl, asq) in before.items():
        assert after[layer][0] is kl and after[layer][1] is asq, f"layer {layer} recorded again"


@pytest.mark.parametrize("scope", ["layer", "mlp"])
@pytest.mark.parametrize("grad", [False, True])
def test_layers_without_gradients_run_unchanged(grad: bool, scope: str) -> None:
    plain, _ = _joint_model(None)
    checkpointed, _ = _joint_model(scope)
    batch = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.set_grad_enabled(grad):
        torch.manual_seed(2)
        expected = plain(input_ids=batch).logits
        torch.manual_seed(2)
        assert torch.equal(checkpointed(input_ids=batch).logits, expected)


def _forward_calls(model: nn.Module) -> dict[str, int]:
    """Counts, by part ("attention", "mlp"), of the decoder layers' forwards run from now on: their first
    projections' calls (a checkpointed MLP runs its `forward` again, not its hooks; its projections' run)."""
    calls = {"attention": 0, "mlp": 0}
    for layer in decoder_layers(model):
        for part in calls:
            module = layer.self_attn.q_proj if part == "attention" else layer.mlp.gate_proj
            module.register_forward_pre_hook(lambda *_, part=part: calls.__setitem__(part, calls[part] + 1))
    return calls


@pytest.mark.parametrize(
    ("scope", "backward_runs"), [("layer", {"attention": 4, "mlp": 4}), ("mlp", {"attention": 0, "mlp": 4})]
)
def test_the_backward_runs_again_only_what_the_scope_checkpoints(scope: str, backward_runs: dict[str, int]) -> None:
    model, stage = _joint_model(scope)
    calls = _forward_calls(model)
    batch = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(6))
    loss, _ = stage.loss(model, batch)
    assert calls == {"attention": 4, "mlp": 4}  # the forward: each of the 4 layers once
    loss.backward()
    assert calls == {part: 4 + runs for part, runs in backward_runs.items()}


def test_the_mlp_scope_needs_an_mlp_module_and_changes_no_layer_without_one() -> None:
    model, _ = _joint_model(None)
    first_mlp_forward = decoder_layers(model)[0].mlp.forward
    del decoder_layers(model)[2].mlp
    with pytest.raises(ValueError, match=r"decoder layer 2 \(LlamaDecoderLayer\) has no `mlp` module"):
        checkpoint_decoder_layers(model, "mlp")
    assert decoder_layers(model)[0].mlp.forward == first_mlp_forward  # layers 0-1 were left as they were


def test_a_second_call_keeps_its_scope_and_refuses_the_other() -> None:
    model, _ = _joint_model("mlp")
    wrapped = decoder_layers(model)[0].mlp.forward
    assert checkpoint_decoder_layers(model, "mlp") == 4 and decoder_layers(model)[0].mlp.forward is wrapped
    with pytest.raises(ValueError, match="checkpointed in scope 'mlp' already, not 'layer'"):
        checkpoint_decoder_layers(model, "layer")


def test_the_recipe_takes_true_false_and_mlp_and_refuses_anything_else() -> None:
    recipe = str(REPO / "recipes" / "joint.yaml")
    for value, expected in (("true", True), ("false", False), ("mlp", "mlp")):
        assert (
            load_recipe(recipe, [f"train.activation_checkpointing={value}"]).train.activation_checkpointing == expected
        )
    with pytest.raises(Exception, match="activation_checkpointing"):
        load_recipe(recipe, ["train.activation_checkpointing=attention"])

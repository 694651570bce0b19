"""Activation checkpointing per decoder layer: the joint stage's loss, terms and gradients equal
those of the same step without it (exactly, in fp32 on the CPU), and a recomputation in the
backward records nothing into the forward's GSM records."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from gsm_train.attention import gsm_collect
from gsm_train.config.schema import load_recipe
from gsm_train.models.model_zoo import tiny_model
from gsm_train.training.activation_checkpoint import checkpoint_decoder_layers
from gsm_train.training.stages import JointStage

REPO = Path(__file__).resolve().parents[1]
# the joint stage with every GSM module training: sparse attention on the gate's top-k, ASQ on K/V,
# the bridge from layer 1 into layers 2-3, the gate's KL on sampled query rows; the base trains too
ALL_ON = [
    "model.name_or_path=tiny-llama",
    "init_from=null",
    "data.seq_len=64",
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


def _joint_model(checkpointed: bool) -> tuple[nn.Module, JointStage]:
    config = load_recipe(str(REPO / "recipes" / "joint.yaml"), ALL_ON)
    model = tiny_model("llama")
    stage = JointStage()
    torch.manual_seed(0)
    stage.prepare(model, config)
    if checkpointed:
        assert checkpoint_decoder_layers(model) == 4
    return model.train(), stage


def _step(checkpointed: bool, batch: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(loss and terms, gradients by name) of one joint micro-step."""
    model, stage = _joint_model(checkpointed)
    torch.manual_seed(1)  # the KL's query rows are drawn in the forward
    loss, terms = stage.loss(model, batch)
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None for g in grads.values())
    return {"loss": loss.detach(), **terms}, grads


def test_checkpointed_layers_give_the_same_loss_and_gradients() -> None:
    batch = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(3))
    plain_terms, plain_grads = _step(False, batch)
    ckpt_terms, ckpt_grads = _step(True, batch)
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
    model, _ = _joint_model(True)
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


@pytest.mark.parametrize("grad", [False, True])
def test_layers_without_gradients_run_unchanged(grad: bool) -> None:
    plain, _ = _joint_model(False)
    checkpointed, _ = _joint_model(True)
    batch = torch.randint(0, 256, (1, 64), generator=torch.Generator().manual_seed(5))
    with torch.set_grad_enabled(grad):
        torch.manual_seed(2)
        expected = plain(input_ids=batch).logits
        torch.manual_seed(2)
        assert torch.equal(checkpointed(input_ids=batch).logits, expected)

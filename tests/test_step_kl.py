"""Step KL (`benchmarks.step_kl`): in fp64 GSM's cached steps give teacher forcing's distributions (KL ~ 0,
gate alone and gate + ASQ, and every feature the joint recipe switches on), and the measure sees a real
difference (GSM's steps against the dense model's teacher forcing)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.step_kl import cached_log_probs, kl_per_step, ratio_interval, step_kl, teacher_log_probs
from gsm_train.attention import gsm_disabled, inject_gsm
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.inference.cache import GSMCache, cache_kwargs
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import tiny_model

REPO = Path(__file__).resolve().parents[1]

SPARSE = {"top_k": 6, "k_min": 2, "gate_head_dim": 16, "dense_layers": [0], "mode": "sparse"}
ASQ = {"enabled": True, "block_size": 8, "cluster_num": 4, "hidden_dim": 8}


def _model(asq: bool) -> torch.nn.Module:
    model = tiny_model("llama").to(torch.float64)
    torch.manual_seed(1)
    kv = ASQ if asq else {"enabled": False}
    inject_gsm(model, GSMConfig.model_validate({"sparse_attention": SPARSE, "kv_compression": kv}), mode="sparse")
    enable_gsm_generation(model, cuda_graphs=False)
    return model


def _ids() -> torch.Tensor:
    return torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("asq", [False, True], ids=["gate only", "gate + ASQ"])
def test_fp64_gsm_steps_give_teacher_forcings_distributions(asq: bool) -> None:
    result = step_kl(_model(asq), _ids(), steps=8)
    assert len(result["gsm_kl_per_step"]) == 8
    assert abs(result["gsm_mean_kl"]) < 1e-12 and abs(result["dense_mean_kl"]) < 1e-12
    assert abs(result["gsm_teacher_self_kl"]) < 1e-12 and abs(result["dense_teacher_self_kl"]) < 1e-12


def test_step_kl_sees_another_models_distributions() -> None:
    model, ids = _model(asq=False), _ids()
    with gsm_disabled(model):
        dense_teacher = teacher_log_probs(model, ids, 8)
    gsm_steps = cached_log_probs(model, ids, 8, GSMCache(model, ids.shape[1]))
    assert kl_per_step(dense_teacher, gsm_steps).min() > 1e-6  # k = 6 of up to 40 keys: not the dense model


def _joint_recipe_at_tiny_sizes() -> dict:
    """recipes/joint.yaml's GSM block at a tiny model's sizes (blocks of 8, a layer at 4/4, sinks and recent
    tokens forced)."""
    gsm = load_recipe(str(REPO / "recipes" / "joint.yaml")).gsm.model_dump()
    gsm["sparse_attention"] |= {"top_k": 6, "k_min": 2, "sink_tokens": 2, "recent_tokens": 3}
    gsm["kv_compression"] |= {"block_size": 8, "hidden_dim": 8, "layer_bits": {2: (4, 4)}}
    return gsm


def test_the_joint_recipe_s_cached_steps_are_its_teacher_forced_pass_in_fp64() -> None:
    """recipes/joint.yaml's GSM block at a tiny model's sizes (int8 gate keys, sinks and recent tokens forced,
    two dense layers, ASQ with 4-bit K / 2-bit V, a layer at 4/4, rotated residuals, two prototypes), every
    module in fp64: from a prompt of 3.5 blocks, 12 cached steps (a block completes and is packed at the 5th)
    give the teacher-forced pass's next-token log-probs to 1e-9 of their size, so the cached step computes
    the same function and step KL's fp32 / bf16 figures are rounding that ASQ's codes amplify
    (docs/design-decisions.md, "Cached steps and teacher forcing differ in fp32 and bf16 only by rounding")."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(_joint_recipe_at_tiny_sizes()), mode="sparse")
    model.double()  # GSM's modules too (they load in fp32): every rounding of both paths in fp64
    enable_gsm_generation(model, cuda_graphs=False)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(0))
    teacher = teacher_log_probs(model, ids, steps=12)
    cached = cached_log_probs(model, ids, 12, GSMCache(model, ids.shape[1], prefill="sparse"))
    assert (cached - teacher).abs().max() <= 1e-9 * teacher.abs().max()
    assert kl_per_step(teacher, cached).abs().max() < 1e-12


def test_the_ratio_interval_is_over_rows_drawn_with_their_pairs() -> None:
    """Rows whose GSM KL is twice their dense KL give 2 in every resampling (doubling is exact), so the interval
    is [2, 2] however unequal the rows; rows of other ratios give an interval around the ratio of the means, the
    same on every call (seeded); a dense KL that is 0 (fp64) gives none."""
    dense = torch.tensor([1e-3, 5e-4, 3e-3, 2e-4, 8e-4])
    assert ratio_interval(2 * dense, dense) == (2.0, 2.0)
    gsm = torch.tensor([1e-3, 4e-3, 2e-3, 9e-4, 5e-3])
    low, high = ratio_interval(gsm, dense)
    assert low < gsm.double().mean() / dense.double().mean() < high
    assert ratio_interval(gsm, dense) == (low, high)
    assert ratio_interval(gsm, torch.zeros(5)) is None


def test_teacher_forcing_reads_the_rows_the_cache_holds_in_bf16(monkeypatch: pytest.MonkeyPatch) -> None:
    """In eval mode a teacher-forced pass attends over K and V as a generation cache packs and reads them back
    (`stored_pair`), so in bf16 the rows it reads equal bit for bit those the cached steps read after a
    sparse prefill, at every layer (recipes/joint.yaml's modules at a tiny model's sizes, no bridge). Before,
    each side was reconstructed from its own encoding and some rows came out a last bit apart."""
    from gsm_train.attention.adapter import GSMAttentionAdapter

    gsm = _joint_recipe_at_tiny_sizes() | {"cross_layer_sharing": {"enabled": False}}
    model = tiny_model("llama").to(torch.bfloat16)
    inject_gsm(model, GSMConfig.model_validate(gsm), mode="sparse")
    enable_gsm_generation(model, cuda_graphs=False)
    read: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    transform = GSMAttentionAdapter.transform_kv

    def recorded(adapter: GSMAttentionAdapter, *args: object) -> tuple:
        out = transform(adapter, *args)
        read[adapter.layer_idx] = out[0], out[1]
        return out

    monkeypatch.setattr(GSMAttentionAdapter, "transform_kv", recorded)
    ids = torch.randint(0, 256, (4, 100), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, use_cache=False)
        teacher = dict(read)
        cache = GSMCache(model, ids.shape[1], prefill="sparse")
        model.gsm_base_forward(input_ids=ids, use_cache=True, **cache_kwargs(model, cache))
    for layer, held in enumerate(cache.layers):
        packed = held.k_store.lengths.packed_len
        assert packed == 96
        assert torch.equal(held.k_store.packed_prefix(packed), teacher[layer][0][:, :, :packed])
        assert torch.equal(held.v_store.packed_prefix(packed), teacher[layer][1][:, :, :packed])

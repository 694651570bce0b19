"""`gsm-train inspect`: per layer, which GSM modules a model gets, their parameters and KV-cache bytes.

KV bytes are per token at `seq_len` for a bf16 cache. Without GSM a layer stores
`2 (K, V) * 2 bytes * kv_heads * head_dim`. With GSM: ASQ stores `bytes_per_token(seq_len)` per KV
head for K and for V; a `share`-mode bridge target does not store its shared heads (a `mix` target
saves nothing); a layer with a gate also stores `gate_head_dim * num_selectors` gate keys, 2 bytes per dimension
(bf16) or, with `gate_key_bits: 8`, 1 byte per dimension plus a 2-byte scale per key. The account is
`gsm_train.tuning.kv_budget.layer_kv_bytes`; the recipe's tuning knobs are resolved first (`resolved_recipe`).

Without a recipe the GSM block enables sparse attention, ASQ and the cache bridge at their defaults;
if the default bridge does not fit the model, `bridge_to_start` becomes `num_layers // 2` and
`bridge_from` the layer below it (a 4-layer model bridges layer 1 into layers 2 and 3; a 1-layer
model gets no bridge). `key.sub=value` overrides (e.g. `gsm.kv_compression.quant_bits=2`) apply to
the recipe or to this default block.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from gsm_train.attention import GSMAttentionAdapter, gsm_adapters, inject_gsm
from gsm_train.config.schema import (
    CrossLayerSharingConfig,
    GSMConfig,
    RecipeConfig,
    apply_overrides,
    check_against_model,
    load_recipe,
    validate_recipe_dict,
)
from gsm_train.models.families import config_dims, model_dims
from gsm_train.models.model_zoo import load_model_and_tokenizer, read_model_config
from gsm_train.tuning.kv_budget import budget_choice, layer_kv_bytes
from gsm_train.tuning.resolved_recipe import resolve_tuning


@dataclass(frozen=True)
class LayerReport:
    """One row of the table."""

    index: int
    modules: str
    params: int
    base_bytes: float
    gsm_bytes: float


def default_gsm_config(num_layers: int) -> GSMConfig:
    """Sparse attention, ASQ and the cache bridge at defaults, with the bridge clamped into the model."""
    bridge = CrossLayerSharingConfig()
    enabled = num_layers >= 2
    if bridge.bridge_to_start >= num_layers:
        to_start = max(num_layers // 2, 1)
        bridge = CrossLayerSharingConfig(bridge_from=min(bridge.bridge_from, to_start - 1), bridge_to_start=to_start)
    return GSMConfig.model_validate(
        {"kv_compression": {"enabled": True}, "cross_layer_sharing": {**bridge.model_dump(), "enabled": enabled}}
    )


def recipe_for(recipe: str | None, overrides: list[str], num_layers: int) -> RecipeConfig:
    """The recipe, or one with the default gsm block, after `overrides`, checked against the model."""
    if recipe is None:
        data = {"stage": "gate_warmup", "gsm": default_gsm_config(num_layers).model_dump()}  # only gsm is used
        config = validate_recipe_dict(data, "default gsm block", apply_overrides(data, overrides))
    else:
        config = load_recipe(recipe, overrides)
    check_against_model(config, num_layers)
    return config


def layer_modules(adapter: GSMAttentionAdapter, config: GSMConfig) -> str:
    """Names of what is attached to one layer, e.g. `gate asq bridge-target(share)`, and how its main attention
    reads (`dense-layer`: no gate; `retrieval-layer`: a gate kept, every key read)."""
    bridge_mode = config.cross_layer_sharing.mode
    parts = [
        name
        for name, present in (
            ("gate", adapter.gate is not None),
            ("asq", adapter.asq_k is not None),
            ("bridge-source", adapter.is_bridge_source),
            (f"bridge-target({bridge_mode})", adapter.bridge is not None),
            ("dense-layer", adapter.dense_layer),
            ("retrieval-layer", adapter.layer_idx in config.sparse_attention.retrieval_layers),
        )
        if present
    ]
    return " ".join(parts) or "-"


def layer_reports(model: nn.Module, config: GSMConfig, seq_len: int) -> list[LayerReport]:
    """One report per decoder layer of an injected model."""
    dims = model_dims(model)
    rows = []
    for index, (_, adapter) in enumerate(gsm_adapters(model)):
        params = sum(param.numel() for param in adapter.parameters())
        rows.append(
            LayerReport(index, layer_modules(adapter, config), params, *layer_kv_bytes(config, dims, index, seq_len))
        )
    return rows


def render(title: str, rows: list[LayerReport]) -> str:
    """Plain-text table with a totals row and the with/without-GSM byte ratio."""
    header = f"{'layer':>5}  {'modules':<40} {'gsm params':>12} {'KV B/tok base':>14} {'KV B/tok gsm':>14}"
    lines = [title, header, "-" * len(header)]
    lines += [
        f"{r.index:>5}  {r.modules:<40} {r.params:>12,} {r.base_bytes:>14,.1f} {r.gsm_bytes:>14,.1f}" for r in rows
    ]
    params, base, gsm = (sum(getattr(r, name) for r in rows) for name in ("params", "base_bytes", "gsm_bytes"))
    lines += [
        "-" * len(header),
        f"{'total':>5}  {'':<40} {params:>12,} {base:>14,.1f} {gsm:>14,.1f}",
        f"KV bytes ratio (gsm / base): {gsm / base:.4f}",
    ]
    return "\n".join(lines)


def inspect_model(model_name: str, recipe: str | None, seq_len: int, overrides: list[str]) -> str:
    """Inject the recipe's (or the default) GSM modules into `model_name` and describe them per layer.
    The recipe is checked and its tuning knobs resolved (as a run of it resolves them) from the
    model's config, before its weights load."""
    model_config = read_model_config(model_name)
    dims = config_dims(model_config)
    recipe_config = resolve_tuning(recipe_for(recipe, overrides, dims["layers"]), model_config)
    config, budget = recipe_config.gsm, recipe_config.tuning.kv_compression_ratio
    model, _ = load_model_and_tokenizer(model_name)
    inject_gsm(model, config)
    title = f"{model_name}: GSM modules and KV cache per token at seq_len={seq_len} (bf16 cache)"
    if budget is not None:
        title += f"\n{budget_choice(config, budget, dims, recipe_config.data.seq_len)}"
    if not config.gsm_enabled:
        title += "\ngsm_enabled is false: the model runs as the base; the gsm column shows what enabling it gives"
    return render(title, layer_reports(model, config, seq_len))

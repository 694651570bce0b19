"""A recipe resolved against its base model's config, before any weights load.

`resolve_tuning(config, model_config)` is the one place a recipe's `tuning` knobs become the gsm
fields they name: `top_k_base` sets `gsm.sparse_attention.top_k`, `bridge_alpha` sets
`gsm.cross_layer_sharing.alpha_init`, and `kv_compression_ratio` sets ASQ's and the gate keys' bits
to the most precise pair within the budget (`kv_budget.fit_kv_budget`, which needs the model's shape
and `data.seq_len`). It is pure: it returns a new recipe and changes nothing, and resolving a
resolved recipe gives it back unchanged. A recipe as loaded (`config.load_recipe`) is checked but
not resolved: its gsm block is the one the recipe gives.

`resolve_for_base(config)` reads the base's config without its weights
(`model_zoo.read_model_config`), checks the recipe against the base's shape and resolves it.
`gsm-train train` (in its pre-flight checks), `gsm-train validate`, `gsm-train export` and
`TrainingSession.setup` call it before any weights load, so that an impossible budget is one error
naming the field, its value and the fix, with nothing loaded or written.
"""

from __future__ import annotations

from transformers import PretrainedConfig

from gsm_train.config.schema import ConfigError, Problem, RecipeConfig, check_against_model
from gsm_train.models.families import config_dims
from gsm_train.models.model_zoo import read_model_config
from gsm_train.tuning.kv_budget import fit_kv_budget


def read_base_config(config: RecipeConfig) -> PretrainedConfig:
    """The config (not the weights) of the base model `config.model` names. One that cannot be read
    (a wrong Hub id or revision, no network, a damaged folder) is a ConfigError naming
    `model.name_or_path`."""
    model = config.model
    try:
        return read_model_config(model.name_or_path, model.gguf_file, model.revision)
    except (OSError, ValueError) as err:
        reason = " ".join(str(err).split())[:400]
        fix = (
            "check the Hub id, model.revision and the network (or HF_HUB_OFFLINE=1 with the "
            "model in the cache), or give a local folder"
        )
        raise ConfigError(
            "recipe vs model",
            [Problem("model.name_or_path", model.name_or_path, f"its config cannot be read ({reason})", fix)],
        ) from None


def resolve_tuning(config: RecipeConfig, model_config: PretrainedConfig) -> RecipeConfig:
    """`config` with its tuning knobs resolved into its gsm block for the base `model_config`
    describes: a new recipe (its gsm block a copy; `config` is not changed). Stage `math_gate` takes
    its modules from its `init_from` export and no knobs, so its recipe comes back as given. Raises
    ConfigError naming `tuning.kv_compression_ratio`, its value and the fix when no storage reaches
    the budget."""
    if config.stage == "math_gate":
        return config
    knobs, gsm = config.tuning, config.gsm
    top_k = {} if knobs.top_k_base is None else {"top_k": knobs.top_k_base}
    alpha = {} if knobs.bridge_alpha is None else {"alpha_init": knobs.bridge_alpha}
    resolved = gsm.model_copy(
        update={
            "sparse_attention": gsm.sparse_attention.model_copy(update=top_k, deep=True),
            "cross_layer_sharing": gsm.cross_layer_sharing.model_copy(update=alpha, deep=True),
        },
        deep=True,
    )
    if knobs.kv_compression_ratio is not None:
        dims = config_dims(model_config)
        resolved = fit_kv_budget(resolved, knobs.kv_compression_ratio, dims, config.data.seq_len)
    return config.model_copy(update={"gsm": resolved})


def resolve_for_base(config: RecipeConfig) -> tuple[RecipeConfig, PretrainedConfig]:
    """The config of the base `config` names (read without its weights: `read_base_config`), the
    recipe checked against it (`config.check_against_model`: layer indices, `data.seq_len` within its
    context, modules no wider than its heads) and resolved (`resolve_tuning`); the resolved recipe and
    that config. Raises ConfigError naming each field that does not fit."""
    model_config = read_base_config(config)
    dims = config_dims(model_config)
    check_against_model(config, dims["layers"], dims["context"] or None, dims["kv_heads"], dims["head_dim"])
    return resolve_tuning(config, model_config), model_config

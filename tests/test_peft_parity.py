"""Save, load, merge and publish as PEFT users expect, on a tiny random Llama with GSM modules and LoRA
deltas: `GSMModel.save_pretrained` writes the model in memory and `from_pretrained` gives its logits
back exactly (the model's own transformers `save_pretrained` refuses, as it would drop the adapter);
`push_to_hub` uploads the model in memory (checked in the commit request the local Hub stand-in
receives), also for a model loaded from a Hub id; PEFT loading an export warns that it leaves GSM out,
and a copy PEFT saves again is refused with the reason; the built-in SmolLM2 base is recorded as the
de-quantized GGUF it is; `merge_and_unload` keeps the logits and its export loads onto the base or
onto the merged base; the model card passes huggingface_hub's card checks and its snippet runs.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import re
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.repocard_data import model_index_to_eval_results
from huggingface_hub.utils import get_session
from safetensors.torch import load, load_file
from test_hub import REPO, TOKEN, _committed, endpoint, hub, hub_env  # noqa: F401  (fixtures)

from gsm_train import GSMModel
from gsm_train.attention import gsm_disabled, gsm_state_dict, inject_gsm
from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.export.adapter_format import BASE_FILE, CARD_FILE, CONFIG_FILE, GSM_FILE, PEFT_CONFIG_FILE, ExportError
from gsm_train.export.hub import publish_export
from gsm_train.export.lora import PEFT_NOTE_KEY, inject_lora, lora_parameters
from gsm_train.export.model_card import PLACEHOLDER, build_card, usage_snippet
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.models.fingerprint import base_fingerprint
from gsm_train.models.model_zoo import (
    SMOLLM2_FILE,
    SMOLLM2_SHA256,
    byte_tokenizer,
    fetch_smollm2,
    load_model_and_tokenizer,
    tiny_model,
)
from gsm_train.modules import GSMError

REPO_ROOT = Path(__file__).resolve().parents[1]
GSM = {
    "sparse_attention": {"top_k": 8, "k_min": 8, "gate_init": "random"},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4},
}
LORA = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
RECIPE = {
    "stage": "joint",
    "data": {"seq_len": 64, "train": {"path": "hf://wikitext:wikitext-2-raw-v1@train"}},
    "train": {"steps": 8},
}
METRICS = {"ppl": 12.5, "gate_mass_k8": 0.9, "oracle_mass_k8": 0.95, "recall_ratio_k8": 0.947, "kl": 0.2}
IDS = torch.arange(64).reshape(2, 32) * 7 % 256


def _nudge(model: torch.nn.Module, marker: str, seed: int, scale: float = 0.05) -> None:
    """Move every floating tensor whose name holds `marker` by seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if marker in name and tensor.is_floating_point():
                tensor.add_(scale * torch.randn(tensor.shape, generator=generator))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(IDS).logits


@pytest.fixture(scope="module")
def lora_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An export of a tiny Llama with GSM modules and LoRA deltas on q/k/v/o, all off their initial
    values."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    inject_lora(model, LORA)
    _nudge(model, ".gsm.", 0, 0.01)
    _nudge(model, ".lora_B.", 1)
    folder = tmp_path_factory.mktemp("lora") / "export"
    return export_adapter(model, folder, base_name="tiny-llama", lora=LORA.model_dump(), recipe=RECIPE, metrics=METRICS)


def test_save_pretrained_round_trips_the_model_in_memory(lora_export: Path, tmp_path: Path) -> None:
    """Changed in memory (LoRA and GSM tensors), saved and loaded again: the same logits exactly,
    which are not the logits of the export it was loaded from."""
    gsm = GSMModel.from_pretrained(lora_export)
    exported = _logits(gsm.model)
    _nudge(gsm.model, ".lora_B.", 2)
    _nudge(gsm.model, ".gsm.gate.", 3, 0.01)
    in_memory = _logits(gsm.model)
    assert not torch.equal(in_memory, exported)

    saved = gsm.save_pretrained(tmp_path / "saved")
    assert sorted(p.name for p in saved.iterdir()) == sorted(p.name for p in lora_export.iterdir())
    again = GSMModel.from_pretrained(saved)
    assert torch.equal(_logits(again.model), in_memory)
    assert again.training_args == gsm.training_args and again.training_args["metrics"] == METRICS
    assert again.config["base_model"] == gsm.config["base_model"]


def test_save_pretrained_keeps_a_base_trained_in_full(tmp_path: Path) -> None:
    """An export with the whole base (a base trained in full) is saved again with the whole base."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(GSM))
    _nudge(model, "mlp.down_proj", 6)
    folder = export_adapter(model, tmp_path / "export", base_name="tiny-llama", include_base=True)
    gsm = GSMModel.from_pretrained(folder)
    again = gsm.save_pretrained(tmp_path / "again")
    assert load_file(str(again / BASE_FILE)).keys() == load_file(str(folder / BASE_FILE)).keys()
    assert torch.equal(_logits(GSMModel.from_pretrained(again).model), _logits(gsm.model))


def test_the_models_own_save_pretrained_refuses(lora_export: Path, tmp_path: Path) -> None:
    """transformers' save_pretrained of the attached model would write LoRA-wrapped projections as
    `base_layer` and GSM tensors a plain reload drops: it refuses, naming GSMModel.save_pretrained,
    and writes nothing."""
    gsm = GSMModel.from_pretrained(lora_export)
    with pytest.raises(GSMError, match=r"freshly initialised projections.*GSMModel\.save_pretrained\(FOLDER\)"):
        gsm.model.save_pretrained(tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


def test_push_to_hub_uploads_the_model_in_memory(hub, endpoint: str, lora_export: Path) -> None:  # noqa: F811
    """A model loaded by Hub id (its export folder is in the Hub cache, of links) and changed in memory
    pushes its changed tensors: the commit request carries them, and loading the repo gives the
    changed model's logits."""
    publish_export(lora_export, REPO, token=TOKEN)
    gsm = GSMModel.from_pretrained(REPO)
    assert any(p.is_symlink() for p in gsm.folder.iterdir()), "the Hub cache holds links"
    _nudge(gsm.model, ".gsm.gate.", 4, 0.01)
    _nudge(gsm.model, ".lora_B.", 5)
    changed = _logits(gsm.model)

    target = "my-org/gsm-adapter-changed"
    gsm.push_to_hub(target, token=TOKEN)
    commits = [r for r in hub.requests if r.method == "POST" and r.path == f"/api/models/{target}/commit/main"]
    assert len(commits) == 1
    files = _committed(commits[0])[1]
    assert {GSM_FILE, CONFIG_FILE, PEFT_CONFIG_FILE, CARD_FILE} <= set(files)
    sent, memory = load(files[GSM_FILE]), gsm_state_dict(gsm.model)
    assert sent.keys() == memory.keys() and all(torch.equal(sent[name], memory[name]) for name in sent)
    original, gates = load_file(str(lora_export / GSM_FILE)), [name for name in sent if ".gate.q_proj." in name]
    assert gates and not any(torch.equal(sent[name], original[name]) for name in gates)
    assert f'GSMModel.from_pretrained("{target}")' in files[CARD_FILE].decode()
    assert torch.equal(_logits(GSMModel.from_pretrained(target).model), changed)


def test_peft_loading_warns_that_gsm_is_left_out(lora_export: Path, tmp_path: Path) -> None:
    """PeftModel.from_pretrained of an export warns (the key it does not know names what is missing)
    and gives the dense model with the LoRA deltas; a copy it saves again has no GSM modules and our
    loaders refuse it with the reason."""
    from peft import PeftModel

    with pytest.warns(UserWarning, match=PEFT_NOTE_KEY):
        peft_model = PeftModel.from_pretrained(tiny_model("llama"), str(lora_export))
    gsm = GSMModel.from_pretrained(lora_export)
    with gsm_disabled(gsm.model):
        dense = _logits(gsm.model)
    assert torch.equal(_logits(peft_model), dense)

    peft_model.save_pretrained(str(tmp_path / "peft_copy"), save_embedding_layers=False)
    assert not (tmp_path / "peft_copy" / GSM_FILE).exists()
    refusal = r"a PEFT adapter \(adapter_config\.json\) without gsm_config\.json.*drops the GSM modules"
    with pytest.raises(ExportError, match=refusal):
        GSMModel.from_pretrained(tmp_path / "peft_copy")
    with pytest.raises(ExportError, match=refusal):
        load_gsm(tiny_model("llama"), tmp_path / "peft_copy")
    assert PEFT_NOTE_KEY in (lora_export / CARD_FILE).read_text()


@pytest.mark.parametrize(
    ("base_name", "peft_base"),
    [("smollm2-135m", "smollm2-135m"), ("my-org/some-base", "my-org/some-base")],
)
def test_the_base_is_recorded_as_the_weights_trained_on(tmp_path: Path, base_name: str, peft_base: str) -> None:
    """The built-in smollm2-135m is the de-quantized Q4_1 GGUF, not the Hub weights: the export
    records that file and its sha256, and adapter_config.json does not send PEFT to the Hub
    weights. (A tiny model stands for the base: only its name matters here.) A Hub id base is the
    Hub's weights and is named as such."""
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(GSM))
    inject_lora(model, LORA)
    folder = export_adapter(model, tmp_path / "export", base_name=base_name, lora=LORA.model_dump())
    base = json.loads((folder / CONFIG_FILE).read_text())["base_model"]
    peft_config = json.loads((folder / PEFT_CONFIG_FILE).read_text())
    assert peft_config["base_model_name_or_path"] == peft_base
    card = (folder / CARD_FILE).read_text()
    if base_name == "smollm2-135m":
        assert base["hub_id"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
        assert (base["weights"]["file"], base["weights"]["sha256"]) == (SMOLLM2_FILE, SMOLLM2_SHA256)
        assert "its weights are **not** the Hub's" in card and SMOLLM2_FILE in card
    else:
        assert "weights" not in base and "not** the Hub's" not in card


def test_merge_and_unload_keeps_the_logits_and_loads_back(lora_export: Path, tmp_path: Path) -> None:
    """Merged: no LoRA layer left and the logits of the unmerged model (fp32 rounding); saved and
    loaded onto the base the export names, or onto a plain base with the deltas merged (what a PEFT
    user merges and saves), it gives the merged model's logits exactly; any other base is refused."""
    gsm = GSMModel.from_pretrained(lora_export)
    unmerged = _logits(gsm.model)
    assert gsm.merge_and_unload() is gsm
    assert not list(lora_parameters(gsm.model)) and gsm.config["lora"] is None
    merged = _logits(gsm.model)
    assert (merged - unmerged).abs().max() < 1e-4

    folder = gsm.save_pretrained(tmp_path / "merged")
    record = json.loads((folder / CONFIG_FILE).read_text())["base_model"]["merged_lora"]
    weights = load_file(str(folder / BASE_FILE))
    assert sorted(weights) == record["weights"] and len(weights) == 4 * len(LORA.target_modules)
    assert not (folder / PEFT_CONFIG_FILE).exists()
    reloaded = GSMModel.from_pretrained(folder)
    assert torch.equal(_logits(reloaded.model), merged)
    again = reloaded.save_pretrained(tmp_path / "merged_again")
    assert load_file(str(again / BASE_FILE)).keys() == weights.keys(), "saved again: still the merged weights only"

    merged_base = tiny_model("llama")  # saved as a plain transformers folder, as a PEFT user saves a merge
    merged_base.load_state_dict(weights, strict=False)
    merged_base.save_pretrained(tmp_path / "merged_base")
    byte_tokenizer().save_pretrained(tmp_path / "merged_base")
    onto_merged = GSMModel.from_pretrained(folder, base=str(tmp_path / "merged_base"))
    assert torch.equal(_logits(onto_merged.model), merged)
    with pytest.raises(ExportError, match="nor the merged base's"):
        load_gsm(tiny_model("llama", seed=1), folder)


def test_merging_an_adapter_without_lora_is_refused(tmp_path: Path) -> None:
    model = tiny_model("llama")
    inject_gsm(model, GSMConfig.model_validate(GSM))
    gsm = GSMModel.from_pretrained(export_adapter(model, tmp_path / "export", base_name="tiny-llama"))
    with pytest.raises(GSMError, match="no LoRA deltas to merge"):
        gsm.merge_and_unload()


class _ToStandIn:
    """A session that sends each POST to the stand-in Hub at `url`, whatever host the caller named:
    huggingface_hub versions differ in where `ModelCard.validate` posts (`constants.ENDPOINT`, or the
    public Hub's address written out)."""

    def __init__(self, url: str) -> None:
        self.url = url

    def post(self, url: str, **kwargs: object) -> object:
        return get_session().post(self.url + urlsplit(url).path, **kwargs)


def test_the_card_passes_huggingface_hubs_card_checks(hub, lora_export: Path, tmp_path: Path) -> None:  # noqa: F811
    """The card parses strictly, its metadata round-trips through ModelCardData and its model-index,
    the Hub's metadata check (the stand-in's validate-yaml) accepts it; every metric has a meaning;
    it says what the adapter saves, how to use it, its intended use and its limitations."""
    text = (lora_export / CARD_FILE).read_text()
    card = ModelCard(text, ignore_metadata_errors=False)
    data = card.data.to_dict()
    assert ModelCardData(**data).to_dict() == data
    _, results = model_index_to_eval_results(data["model-index"])
    assert {r.metric_type for r in results} == {"perplexity", *(k for k in METRICS if k != "ppl")}
    assert all(r.metric_name and r.metric_name != r.metric_type for r in results), "names are explained"

    with pytest.MonkeyPatch.context() as patch:  # the check's POST goes to the stand-in, by any endpoint it names
        patch.setattr("huggingface_hub.repocard.get_session", lambda: _ToStandIn(hub.url))
        card.validate()
    assert ("POST", "/api/validate-yaml") in hub.routes

    rows = [line.split(" | ") for line in text.splitlines() if line.startswith("| ") and "`" in line]
    assert len(rows) == len(METRICS) and all(len(row) == 3 and len(row[2]) > 20 for row in rows)
    assert re.search(r"KV cache: \d\.\d{3} of the base's bf16 cache at 64 tokens", text)
    assert "speed: not measured" in build_card(json.loads((lora_export / CONFIG_FILE).read_text()), {})
    sped = {"recipe": RECIPE, "metrics": {**METRICS, "decode_speedup": 1.56}}
    assert "Decode speed-up: 1.56" in build_card(json.loads((lora_export / CONFIG_FILE).read_text()), sped)
    assert "## Intended use" in text and "## Limitations" in text
    assert "```python\n" + usage_snippet(PLACEHOLDER) + "\n```" in text


def test_the_cards_snippet_runs_and_is_the_readmes(hub, endpoint: str, lora_export: Path) -> None:  # noqa: F811
    """Published, the card's Python block runs as written (by repo id, against the stand-in Hub) and
    prints the prompt's continuation; the README's Python example is the same snippet."""
    publish_export(lora_export, REPO, token=TOKEN)
    card = _committed(hub.requests[-1])[1][CARD_FILE].decode()
    code = re.search(r"```python\n(.*?)```", card, re.S)[1]
    assert code.strip() == usage_snippet(REPO)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(code, "card-snippet", "exec"), {})
    assert printed.getvalue().startswith("The capital of France is") and len(printed.getvalue()) > 30
    assert usage_snippet("ORG/NAME") in (REPO_ROOT / "README.md").read_text()


def test_a_smollm2_export_names_the_gguf_it_was_trained_on(tmp_path: Path) -> None:
    """On the real built-in SmolLM2: the export records the GGUF file this machine de-quantized (its
    sha256 is the file's) and the fingerprint of the weights it loads, and PEFT is not pointed at the
    Hub weights. (Saving and loading back are checked on the tiny model above.)"""
    model, _ = load_model_and_tokenizer("smollm2-135m")
    expected_fingerprint = base_fingerprint(model.state_dict())
    gates = {"sparse_attention": {"top_k": 16, "k_min": 16, "gate_init": "random"}}
    inject_gsm(model, GSMConfig.model_validate(gates))
    lora = LoraSettings(r=2, alpha=4, target_modules=["q_proj"])
    inject_lora(model, lora)
    folder = export_adapter(model, tmp_path / "export", base_name="smollm2-135m", lora=lora.model_dump())
    base = json.loads((folder / CONFIG_FILE).read_text())["base_model"]
    gguf = fetch_smollm2()
    assert base["weights"]["file"] == gguf.name
    assert base["weights"]["sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert base["fingerprint"] == expected_fingerprint
    assert json.loads((folder / PEFT_CONFIG_FILE).read_text())["base_model_name_or_path"] == "smollm2-135m"

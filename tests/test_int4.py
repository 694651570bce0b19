"""A GSM adapter over a 4-bit base (gsm_train/export/int4.py, torchao): the quantized load runs end to end on
the CPU (torch's `_weight_int4pack_mm_for_cpu`), the adapter's tensors stay as exported and in 16/32
bits, only the base's linears are quantized, and what cannot run or must not happen is refused."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import gsm_train.commands.generate as generate_module
from gsm_train import GSMModel
from gsm_train.attention import gsm_state_dict, inject_gsm
from gsm_train.cli import main
from gsm_train.config.schema import GSMConfig, LoraSettings
from gsm_train.export import int4
from gsm_train.export.adapter_format import GSM_FILE
from gsm_train.export.int4 import QuantizationError, base_linears, check_int4, is_quantized, quantize_base, stored_bytes
from gsm_train.export.lora import inject_lora, lora_parameters
from gsm_train.export.save_load import export_adapter, load_gsm
from gsm_train.inference.dense_engine import DenseEngine
from gsm_train.inference.engine import enable_gsm_generation
from gsm_train.models.model_zoo import tiny_model
from gsm_train.modules import GSMError

needs_torchao = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None, reason="the int4 path needs torchao (pip install 'gsm-train[int4]')"
)


@pytest.fixture
def importable_torchao(monkeypatch: pytest.MonkeyPatch) -> None:
    """`import torchao` succeeds (a stand-in module where it is not installed): the refusals that come
    after that check are tested either way."""
    if importlib.util.find_spec("torchao") is None:
        monkeypatch.setitem(sys.modules, "torchao", types.ModuleType("torchao"))


GSM = {
    "sparse_attention": {"top_k": 8, "k_min": 8, "gate_init": "random"},
    "kv_compression": {"enabled": True, "block_size": 8, "cluster_num": 4},
}
LORA = LoraSettings(r=4, alpha=8, target_modules=["q_proj", "v_proj"])
IDS = torch.arange(96).reshape(2, 48) * 7 % 256
INT4 = "int4-g64"  # the tiny models' linears have 64 or 128 inputs: groups of 128 do not fit them all


def _export(folder: Path, lora: bool = False, layers: int = 4) -> Path:
    """A tiny Llama's export, its GSM tensors (and LoRA deltas) moved off their initial values."""
    model = tiny_model("llama", layers)
    inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse")
    if lora:
        inject_lora(model, LORA)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if (".gsm." in name or ".lora_B." in name) and tensor.is_floating_point():
                tensor.add_(0.02 * torch.randn(tensor.shape, generator=generator))
    return export_adapter(
        model,
        folder,
        base_name=f"tiny-llama-{layers}",
        lora=LORA.model_dump() if lora else None,
        recipe={"stage": "joint"},
    )


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _export(tmp_path_factory.mktemp("int4") / "export")


@torch.no_grad()
def _logits(model: torch.nn.Module) -> torch.Tensor:
    return model.eval()(IDS).logits


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


@needs_torchao
def test_the_int4_load_generates_over_the_gsm_cache(export: Path) -> None:
    """Base linears 4-bit, everything else as exported: the GSM tensors bit-identical to the export's
    file, the embeddings and head untouched; the logits those of the full model with its base weights
    rounded to 4 bits (dequantized); generation over the GSM cache runs."""
    full = GSMModel.from_pretrained(export)
    gsm = GSMModel.from_pretrained(export, weights=INT4)
    model = gsm.model

    linears = base_linears(model)
    assert len(linears) == 4 * 7  # q, k, v, o, gate, up, down in each of 4 layers
    assert all(is_quantized(linear) for linear in linears.values())
    exported = load_file(str(export / GSM_FILE))
    state = gsm_state_dict(model)
    assert state.keys() == exported.keys()
    for name, tensor in exported.items():
        assert type(state[name]) is torch.Tensor and torch.equal(state[name], tensor), name
    gsm_linears = [m for n, m in model.named_modules() if ".gsm." in f".{n}." and isinstance(m, torch.nn.Linear)]
    assert gsm_linears and not any(is_quantized(m) for m in gsm_linears)
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        assert torch.equal(model.state_dict()[name], full.model.state_dict()[name])
    # each 4-bit weight: two values a byte, and a float32 scale and zero point per group of 64 inputs
    shapes = [(linear.out_features, linear.in_features) for linear in linears.values()]
    saved = sum(n * k * 4 - (n * k // 2 + k // 64 * n * 2 * 4) for n, k in shapes)
    assert stored_bytes(model) == stored_bytes(full.model) - saved

    # the 4-bit model computes what the full model computes with its weights rounded to 4 bits
    rounded = full.model
    with torch.no_grad():
        for name, linear in base_linears(rounded).items():
            eye = torch.eye(linear.in_features)  # the 4-bit kernel applied to the identity: its weights
            linear.weight.copy_(torch.nn.functional.linear(eye, linears[name].weight).T)
    assert _relative_error(_logits(model), _logits(rounded)) < 1e-4

    prompt = IDS[:1, :20]
    out = model.generate(prompt, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 25)
    assert type(model).__name__ == "LlamaForCausalLM"


@needs_torchao
def test_a_lora_export_is_merged_then_quantized(tmp_path: Path) -> None:
    """LoRA deltas are merged into their base layers before quantization (no LoRA layer is left, the
    merged layer is 4-bit), so the quantized model is near the full model with its deltas."""
    folder = _export(tmp_path / "export", lora=True)
    full = GSMModel.from_pretrained(folder)
    gsm = GSMModel.from_pretrained(folder, weights=INT4)
    assert not list(lora_parameters(gsm.model))
    assert is_quantized(gsm.model.model.layers[0].self_attn.q_proj)
    error = _relative_error(_logits(gsm.model), _logits(full.model))
    assert 0 < error < 0.5  # random tiny weights rounded to 4 bits: near, not equal


@needs_torchao
def test_a_quantized_base_is_never_saved(export: Path, tmp_path: Path) -> None:
    """save_pretrained, push_to_hub (which saves first: nothing is uploaded) and merge_and_unload of a
    4-bit base refuse, naming the fix; nothing is written."""
    gsm = GSMModel.from_pretrained(export, weights=INT4)
    with pytest.raises(GSMError, match=r"save_pretrained: this model's base is quantized.*weights='full'"):
        gsm.save_pretrained(tmp_path / "saved")
    assert not (tmp_path / "saved").exists()
    with pytest.raises(GSMError, match="save_pretrained: this model's base is quantized"):
        gsm.push_to_hub("someone/gsm-int4", endpoint="http://127.0.0.1:9")
    with pytest.raises(GSMError, match="merge_and_unload: this model's base is quantized"):
        gsm.merge_and_unload()


@needs_torchao
def test_gsm_does_not_attach_to_a_base_already_quantized(export: Path) -> None:
    """The fingerprint an adapter records is of the 16-bit base: attaching or loading GSM over 4-bit weights is
    refused, naming the order that works, and the model is left without modules."""
    for attach in (
        lambda model: inject_gsm(model, GSMConfig.model_validate(GSM), mode="sparse"),
        lambda model: load_gsm(model, export),
    ):
        model = tiny_model("llama", 4)
        quantize_base(model, 64)
        with pytest.raises(GSMError, match=r"Int4\w*Tensor .*attach them first .*then quantize the base"):
            attach(model)
        assert not any(".gsm." in name for name in model.state_dict())


def test_refusals_come_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, importable_torchao: None
) -> None:
    """An unknown weight format, torchao missing, a device without a kernel and a dtype the kernel does
    not take are refused by name before the export is even read (the folder does not exist)."""
    missing = tmp_path / "no-export"
    with pytest.raises(QuantizationError, match=r"weights='int8' is not a weight format; use one of full, int4"):
        GSMModel.from_pretrained(missing, weights="int8")
    with pytest.raises(QuantizationError, match=r"runs on the CPU or a CUDA GPU, not on meta"):
        GSMModel.from_pretrained(missing, weights="int4", device="meta")
    with pytest.raises(QuantizationError, match=r"on the CPU runs in float32, bfloat16 or float16, not torch.float64"):
        GSMModel.from_pretrained(missing, weights="int4", dtype=torch.float64)
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, "torchao", None)
        with pytest.raises(QuantizationError, match=r"needs torchao, which is not installed: pip install"):
            GSMModel.from_pretrained(missing, weights="int4")
    with monkeypatch.context() as patch:
        patch.setattr(int4, "CPU_KERNEL", "aten::_weight_int4pack_mm_for_a_cpu_torch_lacks")
        with pytest.raises(QuantizationError, match=r"_weight_int4pack_mm_for_cpu kernel"):
            check_int4("cpu", torch.float32)


def test_gpu_refusals(monkeypatch: pytest.MonkeyPatch, importable_torchao: None) -> None:
    """On a GPU the tinygemm kernel needs compute capability 8.0 and bfloat16 (the GPU is stood in for:
    the check reads only its presence, capability and name); without one, cuda is refused."""
    if not torch.cuda.is_available():
        with pytest.raises(QuantizationError, match=r"this machine has no CUDA device; use device='cpu'"):
            check_int4("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Old GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(QuantizationError, match=r"compute capability 8.0 or newer.*Old GPU is 7.5"):
        check_int4("cuda", torch.bfloat16)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    with pytest.raises(QuantizationError, match=r"on a GPU runs in bfloat16 \(tinygemm\), not torch.float32"):
        check_int4("cuda", torch.float32)
    check_int4("cuda", torch.bfloat16)


@needs_torchao
def test_a_group_that_does_not_fit_is_refused_before_the_model_changes(export: Path) -> None:
    """Groups of 128 over linears of 64 inputs: refused, naming a layer, its width and the format that
    fits, instead of leaving those layers in 16 bits silently."""
    with pytest.raises(QuantizationError, match=r"groups of 128: 24 base linear layers .*64 inputs.*int4-g64"):
        GSMModel.from_pretrained(export, weights="int4")


@needs_torchao
def test_the_cli_generates_and_evaluates_over_a_4bit_base(
    export: Path, tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`gsm-train generate --weights` (with `--compare-dense`: the dense base 4-bit too) and `gsm-train
    eval --weights` run with a 4-bit base; eval's report records it and its 4-bit base and export have
    finite perplexities."""
    quantized = []
    monkeypatch.setattr(generate_module, "quantize_base", lambda m, g: quantized.append(quantize_base(m, g)))
    argv = ["generate", "--adapter", str(export), "--prompt", "hello", "--max-new-tokens", "4", "--weights", INT4]
    assert main([*argv, "--compare-dense"]) == 0
    err = capsys.readouterr().err
    assert "GSM cache: 4 tokens" in err and "dense base: 4 tokens" in err
    assert len(quantized) == 1 and len(quantized[0]) == 28  # the dense base's 28 linears 4-bit too
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    out = tmp_path / "eval"
    argv = ["eval", "--export", f"gsm={export}", "--data", str(text), "--seq-len", "64", "--windows", "2"]
    assert main([*argv, "--weights", INT4, "--first-bucket", "32", "--min-keys", "16", "--out", str(out)]) == 0
    import json

    report = json.loads(next(out.glob("*.json")).read_text())
    assert report["weights"] == INT4
    assert all(torch.isfinite(torch.tensor(r["ppl"])) for r in report["results"].values())


def _prompt(length: int = 21, batch: int = 2) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(0))


def _greedy(model: torch.nn.Module, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=256, **kwargs)


@needs_torchao
def test_generation_over_a_4bit_base_equals_teacher_forcing(export: Path) -> None:
    """The decode engine over a 4-bit base: greedy tokens over the GSM cache (prompt in chunks) equal
    those of the same quantized model without a cache."""
    model = tiny_model("llama")
    load_gsm(model, export)
    quantize_base(model, 64)
    enable_gsm_generation(model, prefill_chunk=8, prefill="sparse")
    ids = _prompt()
    assert torch.equal(_greedy(model, ids), _greedy(model, ids, use_cache=False))


@needs_torchao
def test_the_dense_engine_runs_a_4bit_base() -> None:
    """Our dense engine (the INT4 dense baseline) over a 4-bit base: the tokens of transformers' greedy
    generation of the same quantized model."""
    model = tiny_model("llama")
    quantize_base(model, 64)
    ids = _prompt(29)
    out = DenseEngine(model, prefill_chunk=8).generate(ids, 6)
    assert torch.equal(out, _greedy(model, ids, attention_mask=torch.ones_like(ids)))


@needs_torchao
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and tinygemm's int4 kernel need a GPU")
def test_captured_token_steps_over_a_4bit_base_equal_eager_steps_on_the_gpu(export: Path) -> None:
    """On CUDA (bf16, tinygemm), token steps replayed from CUDA graphs over a 4-bit base give the eager
    steps' tokens, and the base's linears are 4-bit there."""
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    load_gsm(model, export)
    quantize_base(model, 64)
    enable_gsm_generation(model, prefill="sparse")  # the prompt attends as teacher forcing does
    assert all(is_quantized(linear) for linear in base_linears(model).values())
    ids = _prompt(37).cuda()
    captured = _greedy(model, ids)
    assert model.gsm_generation["cuda_graphs"]
    enable_gsm_generation(model, cuda_graphs=False, prefill="sparse")
    assert torch.equal(captured, _greedy(model, ids))


@needs_torchao
def test_awq_scales_come_from_the_calibration_forwards(tmp_path: Path) -> None:
    """With `calibrate`, every base linear is 4-bit with AWQ's input scale (torchao's act_pre_scale, one
    per input channel, searched on the forwards `calibrate` ran: uniform where scaling did not help);
    the GSM tensors stay as exported."""
    export = _export(tmp_path / "export", layers=1)  # AWQ searches 20 scales per linear: few linears
    model = tiny_model("llama", 1)
    load_gsm(model, export)
    calls = []

    def calibrate(m: torch.nn.Module) -> None:
        calls.append(m(_prompt(32, 2)).logits.shape)

    quantize_base(model, 64, calibrate)
    assert calls == [(2, 32, 257)]
    scales = [linear.weight.data.act_pre_scale for linear in base_linears(model).values()]
    assert all(is_quantized(linear) for linear in base_linears(model).values())
    assert all(scale.shape == (linear.in_features,) for scale, linear in zip(scales, base_linears(model).values()))
    assert any(not torch.all(scale == scale[0]) for scale in scales)  # uniform where no scale beat none
    exported = load_file(str(export / GSM_FILE))
    assert all(torch.equal(gsm_state_dict(model)[name], tensor) for name, tensor in exported.items())

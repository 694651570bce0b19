"""4-bit weight-only quantization of a loaded base under a GSM adapter, through torchao.

`weights="int4"` (`int4-g64`, `int4-g32`: smaller groups) quantizes the base's linear layers, each
row's weights in groups of 128 (64, 32) input features with one scale and zero point per group (model dtype)
(torchao's `Int4WeightOnlyConfig` on a GPU, tinygemm kernels; `PrototypeInt4WeightOnlyConfig` on the
CPU, torch's `_weight_int4pack_mm_for_cpu`). What stays as loaded: the GSM modules (gate heads, ASQ,
bridge), the embeddings, the output head, the norms and biases. LoRA deltas are merged into their
base layers first (`lora.merge_lora`), so the quantized layer computes base + delta.

The contract: quantize AFTER `load_gsm` (the base's fingerprint is checked on the 16-bit weights, and an
export's base weights or LoRA deltas are loaded first); `check_int4` refuses what cannot run (torchao
missing, a device without an int4 kernel, a dtype the kernel does not take) before anything loads;
`quantize_base` refuses a base linear whose input width is not a multiple of the group size instead of
leaving it in 16 bits silently. The published artifact stays the adapter: a quantized base is never
saved (`GSMModel.save_pretrained` refuses).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from gsm_train.errors import GSMError
from gsm_train.export.lora import lora_parameters, merge_lora
from gsm_train.export.save_load import AdapterNames

FULL = "full"  # the base's weights as loaded, in the dtype asked for
GROUP_SIZES = {"int4": 128, "int4-g64": 64, "int4-g32": 32}
WEIGHT_CHOICES = (FULL, *GROUP_SIZES)
CPU_KERNEL = "aten::_weight_int4pack_mm_for_cpu"  # torch's int4 matmul on the CPU (torchao's Int4OpaqueTensor)
TORCHAO_INSTALL = "pip install 'torchao>=0.18' (or pip install 'gsm-train[int4]'; torchao 0.18 needs torch >= 2.11)"


class QuantizationError(GSMError):
    """A 4-bit base that cannot be built here; the message names what and the fix."""


def group_size(weights: str) -> int | None:
    """The quantization group of a `weights` choice (None: `full`, not quantized); QuantizationError
    for a value that is not one of WEIGHT_CHOICES."""
    if weights == FULL:
        return None
    if weights not in GROUP_SIZES:
        raise QuantizationError(f"weights={weights!r} is not a weight format; use one of {', '.join(WEIGHT_CHOICES)}")
    return GROUP_SIZES[weights]


def checked_group(weights: str, device: str | torch.device, dtype: torch.dtype) -> int | None:
    """`group_size(weights)`, with a 4-bit base refused where it cannot run (`check_int4`): what an
    entry point calls before anything loads."""
    group = group_size(weights)
    if group is not None:
        check_int4(device, dtype)
    return group


def check_int4(device: str | torch.device, dtype: torch.dtype) -> None:
    """Refuse (QuantizationError) a 4-bit base that cannot run on `device` in `dtype`: torchao not
    installed, no int4 kernel for the device (CPU: torch's `_weight_int4pack_mm_for_cpu`; CUDA: compute
    capability 8.0 or newer, tinygemm), or a dtype that kernel does not take (CUDA: bfloat16 only)."""
    device = torch.device(device)
    try:
        import torchao  # noqa: F401
    except ImportError as err:
        raise QuantizationError(f"weights=int4 needs torchao, which is not installed: {TORCHAO_INSTALL}") from err
    if device.type == "cpu":
        if not _has_cpu_kernel(CPU_KERNEL):
            raise QuantizationError(
                f"weights=int4 on the CPU needs torch's _weight_int4pack_mm_for_cpu kernel, which torch "
                f"{torch.__version__} lacks: use torch >= 2.11, or run on a CUDA GPU"
            )
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise QuantizationError(f"weights=int4 on the CPU runs in float32, bfloat16 or float16, not {dtype}")
    elif device.type == "cuda":
        if not torch.cuda.is_available():
            raise QuantizationError("weights=int4 on cuda: this machine has no CUDA device; use device='cpu'")
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 0):
            raise QuantizationError(
                f"weights=int4 needs a GPU of compute capability 8.0 or newer (torchao's tinygemm kernel); "
                f"{torch.cuda.get_device_name(device)} is {capability[0]}.{capability[1]}: use weights='full'"
            )
        if dtype != torch.bfloat16:
            raise QuantizationError(f"weights=int4 on a GPU runs in bfloat16 (tinygemm), not {dtype}: load in bfloat16")
    else:
        raise QuantizationError(f"weights=int4 runs on the CPU or a CUDA GPU, not on {device.type}")


def _has_cpu_kernel(name: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
    except RuntimeError:  # no such operator in this torch
        return False


def base_linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers `quantize_base` quantizes, by name: every `nn.Linear` of the base except the
    output head and those of the GSM modules and LoRA layers."""
    names = AdapterNames.of(model)
    head = model.get_output_embeddings()
    return {
        name: module
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and module is not head
        and f"{name}.weight" not in names
        and ".gsm." not in f".{name}."
        and ".lora_" not in f".{name}"
    }


def is_quantized(linear: nn.Linear) -> bool:
    """Whether `linear`'s weight is one of torchao's quantized tensors (a tensor subclass)."""
    return type(linear.weight.data) is not torch.Tensor


def quantize_base(model: nn.Module, group: int, calibrate: Callable[[nn.Module], None] | None = None) -> list[str]:
    """Quantize `model`'s base linears (`base_linears`) to 4-bit weights in groups of `group` input
    features, in place, on the device they are on; LoRA deltas are merged into their layers first.
    `calibrate`: AWQ scales (`_awq`), `calibrate(model)` running the forwards they are observed on;
    None: data-free (each group's grid from its min and max). Returns the quantized layers' names.
    QuantizationError, before anything changes, where a layer's input width is not a multiple of
    `group` (naming the group sizes that fit)."""
    linears = base_linears(model)
    if not linears:
        raise QuantizationError(
            f"weights=int4: {type(model).__name__} has no linear layers outside its head to quantize"
        )
    misfits = {name: linear.in_features for name, linear in linears.items() if linear.in_features % group}
    if misfits:
        widths = sorted(set(misfits.values()))
        fits = [name for name, size in GROUP_SIZES.items() if all(w % size == 0 for w in widths)]
        name = next(iter(misfits))
        raise QuantizationError(
            f"weights=int4 with groups of {group}: {len(misfits)} base linear layers (e.g. {name}, "
            f"{misfits[name]} inputs) have an input width that is not a multiple of {group}; "
            + (f"use weights={fits[0]!r}" if fits else "this base cannot be quantized in groups of 32, 64 or 128")
        )
    if any(True for _ in lora_parameters(model)):
        merge_lora(model)
        linears = base_linears(model)
    from torchao.quantization import quantize_

    config = _config(group, next(iter(linears.values())).weight.device)
    chosen = lambda module, name: name in linears  # noqa: E731
    if calibrate is None:
        quantize_(model, config, filter_fn=chosen)
    else:
        _awq(model, config, chosen, calibrate)
    return sorted(linears)


def _awq(model: nn.Module, config: object, chosen: Callable, calibrate: Callable[[nn.Module], None]) -> None:
    """AWQ through torchao (prototype): each chosen linear records its inputs over `calibrate(model)`,
    then is quantized with the per-input-channel scale (a power of the inputs' mean magnitude, searched
    over 20 exponents) that keeps its outputs on those inputs closest; the inverse scale multiplies its
    input at run time. The recorded inputs are held on the CPU until then."""
    from torchao.prototype.awq import AWQConfig
    from torchao.quantization import quantize_

    quantize_(model, AWQConfig(config, step="prepare"), filter_fn=chosen)
    with torch.no_grad():
        calibrate(model)
    quantize_(model, AWQConfig(config, step="convert"), filter_fn=chosen)


def _config(group: int, device: torch.device) -> object:
    """torchao's int4 weight-only config for `device`: tinygemm's tile-packed layout on a GPU, the CPU
    kernel's opaque layout on the CPU; torch's inductor settings are left alone."""
    if device.type == "cuda":
        from torchao.quantization import Int4WeightOnlyConfig

        return Int4WeightOnlyConfig(
            group_size=group, int4_packing_format="tile_packed_to_4d", set_inductor_config=False
        )
    from torchao.prototype.quantization.int4 import PrototypeInt4WeightOnlyConfig

    return PrototypeInt4WeightOnlyConfig(group_size=group, set_inductor_config=False)


def stored_bytes(model: nn.Module) -> int:
    """Bytes of `model`'s parameters as stored: a quantized weight's packed 4-bit values, scales and
    zero points, every other tensor at its dtype's size (tied tensors counted once)."""
    seen, total = set(), 0
    for tensor in model.parameters():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        parts = [tensor] if type(tensor.data) is torch.Tensor else _inner_tensors(tensor.data)
        total += sum(part.numel() * part.element_size() for part in parts)
    return total


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The plain tensors a torchao tensor subclass holds (`__tensor_flatten__`)."""
    names, _ = tensor.__tensor_flatten__()
    return [getattr(tensor, name) for name in names if getattr(tensor, name) is not None]

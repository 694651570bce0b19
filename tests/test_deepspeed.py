"""Choosing the distributed backend from the accelerate config (CI has no deepspeed): the settings
`accelerate launch` exports for launch/deepspeed_zero{2,3}.yaml select DeepSpeed with their ZeRO
stage; without the deepspeed package that is one clear error before any output; FSDP2 otherwise. An
accelerate FSDP config, or a mixed precision the recipe does not ask for, is refused before any
output (gsm-train runs its own FSDP2 and precision)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from accelerate.commands.launch import _validate_launch_command, launch_command_parser
from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env
from run_helpers import TINY_MODEL, records

from gsm_train.config.schema import ConfigError, load_recipe
from gsm_train.train import main as train_main
from gsm_train.training import backend
from gsm_train.training.distributed import DistInfo

REPO = Path(__file__).resolve().parents[1]
RECIPE = str(REPO / "recipes" / "gate_only.yaml")
TINY = [
    *TINY_MODEL,
    "logging.progress_bar=false",
    "gsm.sparse_attention.gate_init=random",
]


def _launch_env(config_file: str) -> dict[str, str]:
    """The ACCELERATE_* and FSDP_* variables `accelerate launch --config_file FILE` (in launch/, or
    a path) gives each process, computed by accelerate's own launcher code (nothing is started)."""
    argv = ["--config_file", str(REPO / "launch" / config_file), "-m", "gsm_train.train", "--recipe", RECIPE]
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv))
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        env = prepare_deepspeed_cmd_env(args)[1]
    else:
        env = prepare_multi_gpu_env(args)
    return {key: value for key, value in env.items() if key.startswith(("ACCELERATE_", "FSDP_"))}


@pytest.fixture
def launched(monkeypatch: pytest.MonkeyPatch):
    """Put the environment of one accelerate config into this process."""

    def apply(config_file: str) -> dict[str, str]:
        env = _launch_env(config_file)
        for key, value in env.items():
            monkeypatch.setenv(key, value)
        return env

    return apply


class _FakeDeepSpeedBackend:
    def __init__(self, config, plugin):
        self.config, self.plugin = config, plugin


@pytest.mark.parametrize(("config_file", "stage"), [("deepspeed_zero2.yaml", 2), ("deepspeed_zero3.yaml", 3)])
def test_zero_configs_select_deepspeed_with_their_stage(
    launched, monkeypatch: pytest.MonkeyPatch, config_file: str, stage: int
) -> None:
    env = launched(config_file)
    assert env["ACCELERATE_MIXED_PRECISION"] == "bf16"
    monkeypatch.setitem(sys.modules, "deepspeed", ModuleType("deepspeed"))  # stands in for the installed package
    fake = ModuleType("gsm_train.training.deepspeed_backend")
    fake.DeepSpeedBackend = _FakeDeepSpeedBackend
    monkeypatch.setitem(sys.modules, "gsm_train.training.deepspeed_backend", fake)
    config = load_recipe(RECIPE, TINY)
    chosen = backend.select_backend(config)
    assert isinstance(chosen, _FakeDeepSpeedBackend)
    plugin = chosen.plugin
    assert plugin.zero_stage == stage and not plugin.zero3_init_flag
    assert plugin.gradient_clipping == config.optim.max_grad_norm == 1.0


def test_missing_deepspeed_is_one_clear_error_before_any_output(
    launched, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    launched("deepspeed_zero2.yaml")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` fails
    status = train_main(["--recipe", RECIPE, *TINY, f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err
    assert "1 problem" in err and "import deepspeed" in err and "pip install 'gsm-train[deepspeed]'" in err
    assert not (tmp_path / "run").exists()


def test_settings_that_contradict_the_recipe_are_reported_with_the_missing_package(
    launched, monkeypatch: pytest.MonkeyPatch
) -> None:
    launched("deepspeed_zero3.yaml")
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    with pytest.raises(ConfigError) as caught:
        backend.select_backend(load_recipe(RECIPE, [*TINY, "optim.max_grad_norm=0.5"]))
    paths = [problem.path for problem in caught.value.problems]
    assert paths == ["distributed_type", "deepspeed_config.gradient_clipping"]
    assert "optim.max_grad_norm (0.5)" in str(caught.value)


def test_fsdp2_is_the_default(launched, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("ACCELERATE_USE_DEEPSPEED", raising=False)
    config = load_recipe(RECIPE, TINY)
    assert isinstance(backend.select_backend(config), backend.FSDP2Backend)
    launched("multi_gpu.yaml")
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # not needed, so never imported
    assert isinstance(backend.select_backend(config), backend.FSDP2Backend)
    assert train_main(["--recipe", RECIPE, *TINY, "train.steps=1", f"output.dir={tmp_path}"]) == 0
    setup = next(r for r in records(tmp_path) if r["kind"] == "setup")
    assert setup["backend"] == "fsdp2"


class _AutocastOffEngine:
    """Stands in for DeepSpeed's engine: its forward switches off an autocast active around it, as
    `autocast_if_enabled` does on CUDA when DeepSpeed's own `torch_autocast` is not configured."""

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def __call__(self, *args, **kwargs):
        with torch.autocast("cpu", enabled=False):
            return self.module(*args, **kwargs)


class _FakeAccelerator:
    """Like accelerate's DeepSpeed integration in bf16: the engine casts every parameter to bf16."""

    def __init__(self, **kwargs):
        pass

    def prepare(self, model, optimizer):
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        return _AutocastOffEngine(model), optimizer


class _Upcasting(torch.nn.Module):
    """A GSM-style computation: fp32 inputs to a matmul, which autocast runs in bf16."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 8))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, bool]:
        return torch.matmul(x.float(), self.weight.float()), torch.is_autocast_enabled("cpu")


def test_deepspeed_runs_the_loops_autocast_from_fp32_masters(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed would run the forward in plain bf16 (the GSM modules' fp32 matmuls in fp32, no fp32
    softmax/log), unlike FSDP2's bf16 parameters under the loop's autocast, and would start its fp32
    masters from the bf16-cast parameters; the backend re-enters the autocast and restores the masters."""
    masters: dict[int, torch.Tensor] = {}
    monkeypatch.setitem(sys.modules, "deepspeed", ModuleType("deepspeed"))
    utils = ModuleType("deepspeed.utils")
    utils.safe_get_full_fp32_param = lambda param: masters.get(id(param), param)
    utils.safe_set_full_fp32_param = lambda param, value: masters.__setitem__(id(param), value.clone())
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    monkeypatch.delitem(sys.modules, "gsm_train.training.deepspeed_backend", raising=False)
    module = importlib.import_module("gsm_train.training.deepspeed_backend")
    monkeypatch.setattr(module, "Accelerator", _FakeAccelerator)
    info = DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    x = torch.randn(2, 8)
    for compute_dtype, expected in ((torch.bfloat16, torch.bfloat16), (None, torch.float32)):
        model = _Upcasting()
        weight = model.weight.detach().clone()
        chosen = module.DeepSpeedBackend(load_recipe(RECIPE, TINY), SimpleNamespace(deepspeed_config={}))
        engine, _ = chosen.prepare(model, lambda m: torch.optim.AdamW(m.parameters()), info, compute_dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compute_dtype is not None):
            out, autocast_on = engine(x)
        assert out.dtype == expected and autocast_on == (compute_dtype is not None)
        assert not torch.equal(weight.to(torch.bfloat16).float(), weight)  # bf16 would lose low bits
        assert torch.equal(masters[id(model.weight)], weight)


class _Zero3Optimizer:
    """Stands in for DeepSpeed's ZeRO-3 optimizer: each rank holds `ceil(numel / world)` fp32 values,
    the last rank's padded at the end."""

    def __init__(self, rank: int, partition: torch.Tensor):
        self.rank, self.partition = rank, partition

    def _get_fp32_opt_state_partition(self, param: torch.nn.Parameter, release_swap_buffers: bool):
        return self.partition, 0

    def _get_param_partition_rank(self, param: torch.nn.Parameter) -> int:
        return self.rank

    def _swappable_optimizer_subgroup(self, group: int) -> bool:
        return False


@pytest.mark.parametrize(("numel", "world"), [(1, 2), (5, 2), (7, 3), (8, 2)])
def test_zero3_master_partitions_take_their_slice_padding_included(
    monkeypatch: pytest.MonkeyPatch, numel: int, world: int
) -> None:
    """DeepSpeed 0.19's set_full_hp_param fails on a rank whose partition reaches into the padding
    (a 1-element bridge alpha on 2 ranks hung ZeRO-3 on the GPU); every rank gets its slice, zeros beyond."""
    monkeypatch.setitem(sys.modules, "deepspeed", ModuleType("deepspeed"))
    utils = ModuleType("deepspeed.utils")
    utils.safe_get_full_fp32_param = utils.safe_set_full_fp32_param = None
    monkeypatch.setitem(sys.modules, "deepspeed.utils", utils)
    monkeypatch.delitem(sys.modules, "gsm_train.training.deepspeed_backend", raising=False)
    module = importlib.import_module("gsm_train.training.deepspeed_backend")
    value = torch.arange(1, numel + 1, dtype=torch.float32)
    size = -(-numel // world)
    gathered = []
    for rank in range(world):
        param = torch.nn.Parameter(torch.empty(0))
        param.ds_id = 0
        param._z3_optimizer = _Zero3Optimizer(rank, torch.full((size,), -1.0))
        module._set_fp32_master(param, value)
        gathered.append(param._z3_optimizer.partition)
    assert torch.equal(torch.cat(gathered), torch.cat([value, torch.zeros(size * world - numel)]))


FSDP_PLUGIN_CONFIG = """compute_environment: LOCAL_MACHINE
distributed_type: FSDP
num_processes: 2
num_machines: 1
mixed_precision: 'no'
use_cpu: false
fsdp_config:
  fsdp_version: 2
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_reshard_after_forward: true
  fsdp_state_dict_type: FULL_STATE_DICT
"""


def test_an_accelerate_fsdp_config_is_refused_before_any_output(
    launched, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    config_file = tmp_path / "fsdp.yaml"
    config_file.write_text(FSDP_PLUGIN_CONFIG)
    env = launched(str(config_file))
    assert env["ACCELERATE_USE_FSDP"] == "true" and env["FSDP_VERSION"] == "2"
    status = train_main(["--recipe", RECIPE, *TINY, f"output.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err
    assert status == 2 and "Traceback" not in err and "1 problem" in err
    assert "distributed_type = 'FSDP'" in err and "its own FSDP2" in err
    assert "launch/multi_gpu.yaml" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    ("precision", "recipe_precision", "refused"),
    [
        ("fp16", "auto", True),
        ("fp16", "bf16", True),
        ("bf16", "no", True),
        ("bf16", "auto", False),
        ("bf16", "bf16", False),
        ("no", "no", False),
    ],
)
def test_accelerate_mixed_precision_follows_the_recipe_or_is_refused(
    launched, tmp_path: Path, precision: str, recipe_precision: str, refused: bool
) -> None:
    config_file = tmp_path / "multi_gpu.yaml"
    text = (REPO / "launch" / "multi_gpu.yaml").read_text()
    config_file.write_text(text.replace('mixed_precision: "no"', f'mixed_precision: "{precision}"'))
    assert launched(str(config_file))["ACCELERATE_MIXED_PRECISION"] == precision
    config = load_recipe(RECIPE, [*TINY, f"distributed.mixed_precision='{recipe_precision}'"])
    if not refused:
        assert isinstance(backend.select_backend(config), backend.FSDP2Backend)
        return
    with pytest.raises(ConfigError) as caught:
        backend.select_backend(config)
    assert [(p.path, p.value) for p in caught.value.problems] == [("mixed_precision", precision)]
    assert "distributed.mixed_precision" in caught.value.problems[0].fix


def test_bf16_optimizer_moments_are_refused_with_deepspeed(launched, monkeypatch: pytest.MonkeyPatch) -> None:
    launched("deepspeed_zero2.yaml")
    monkeypatch.setitem(sys.modules, "deepspeed", ModuleType("deepspeed"))
    with pytest.raises(ConfigError) as caught:
        backend.select_backend(load_recipe(RECIPE, [*TINY, "optim.state_dtype=bf16"]))
    assert [problem.path for problem in caught.value.problems] == ["optim.state_dtype"]
    assert "set optim.state_dtype: fp32" in str(caught.value)

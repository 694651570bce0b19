"""Recipe validation: strict schema, all problems reported at once, exit status 2, nothing written."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gsm_train.cli import main as cli_main
from gsm_train.config.schema import ConfigError, GSMConfig, check_against_model, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_shipped_recipe_validates(recipe: Path) -> None:
    config = load_recipe(recipe)
    assert config.stage in ("gate_warmup", "joint", "math_gate")
    first_line = recipe.read_text().splitlines()[0]
    assert first_line.startswith("#"), "a recipe starts with a comment"
    assert "accelerate launch" in recipe.read_text(), "a recipe shows its exact launch command"


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_validate_cli_prints_resolved_recipe(recipe: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli_main(["validate", str(recipe)]) == 0
    assert "stage:" in capsys.readouterr().out


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


FOUR_PROBLEMS = """\
stage: gate_warmup
colour: blue
train:
  steps: many
gsm:
  kv_compression:
    cluster_num: 1
data:
  train:
    path: /nonexistent/corpus.txt
"""


def test_four_problems_reported_together_exit_2_nothing_written(tmp_path: Path) -> None:
    recipe = _write(tmp_path, FOUR_PROBLEMS)
    before = sorted(tmp_path.rglob("*"))
    proc = subprocess.run(
        [sys.executable, "-m", "gsm_train.cli", "train", str(recipe), f"output.dir={tmp_path / 'run'}"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    err = proc.stderr
    assert "4 problems" in err
    for path, fix in [
        ("colour", "remove it"),
        ("train.steps", "give a value of that type"),
        ("gsm.kv_compression.cluster_num", "greater than or equal to 2"),
        ("data.train.path", "give an existing file"),
    ]:
        assert path in err and fix in err, (path, err)
    assert "'/nonexistent/corpus.txt'" in err and "'many'" in err and "= 1" in err
    assert "Traceback" not in err
    assert sorted(tmp_path.rglob("*")) == before, "a rejected recipe writes nothing"


def test_duplicate_yaml_keys_are_errors(tmp_path: Path) -> None:
    recipe = _write(tmp_path, "stage: gate_warmup\ntrain:\n  steps: 5\n  steps: 6\n")
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe)
    assert [p.path for p in info.value.problems] == ["steps"]
    assert "duplicate key" in str(info.value) and "line 4" in str(info.value)


def test_overrides_are_validated_like_the_file(tmp_path: Path) -> None:
    recipe = RECIPES[0]
    config = load_recipe(recipe, ["train.steps=7", "gsm.sparse_attention.top_k=128"])
    assert config.train.steps == 7 and config.gsm.sparse_attention.top_k == 128
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe, ["train.stepz=7", "gsm.sparse_attention.top_k=0", "nonsense"])
    paths = sorted(p.path for p in info.value.problems)
    assert paths == ["<override>", "gsm.sparse_attention.top_k", "train.stepz"]


@pytest.mark.parametrize(
    "override, path",
    [
        ("gsm.kv_compression.quant_bits=3", "gsm.kv_compression.quant_bits"),
        ("gsm.sparse_attention.top_k=70000", "gsm.sparse_attention.top_k"),
        ("gsm.sparse_attention.gate_head_dim=63", "gsm.sparse_attention.gate_head_dim"),
        ("gsm.sparse_attention.k_min=100", "gsm.sparse_attention"),
        ("gsm.cross_layer_sharing.bridge_from=30", "gsm.cross_layer_sharing"),
        ("logging.recall_min_keys=4096", "<recipe>"),
    ],
)
def test_ranges_and_relations(override: str, path: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(RECIPES[0], [override])
    assert [p.path for p in info.value.problems] == [path]
    assert all(p.fix for p in info.value.problems)


FRACTION = "gsm.sparse_attention.top_k_fraction"
SCHEDULE = "gsm.sparse_attention.top_k_schedule"


@pytest.mark.parametrize(
    ("overrides", "message", "fix"),
    [
        ([f"{SCHEDULE}=fraction"], "top_k_fraction is not set", "set top_k_fraction"),
        ([f"{FRACTION}=0.25"], "top_k_schedule is 'constant'", "set top_k_schedule: fraction"),
        (
            [f"{SCHEDULE}=fraction", f"{FRACTION}=1.5"],
            "less than or equal to 1",
            "use a value that is less than or equal to 1",
        ),
        ([f"{SCHEDULE}=fraction", f"{FRACTION}=0"], "greater than 0", "use a value that is greater than 0"),
    ],
)
def test_the_fraction_schedule_and_its_fraction_come_together(
    overrides: list[str], message: str, fix: str, capsys: pytest.CaptureFixture
) -> None:
    """One clear error naming the field, its value where it has one, and the fix; exit status 2."""
    assert cli_main(["validate", str(RECIPES[0]), *overrides]) == 2
    err = capsys.readouterr().err
    assert "1 problem:" in err and "gsm.sparse_attention" in err and message in err and fix in err


def test_the_fraction_schedule_validates_with_its_fraction() -> None:
    config = load_recipe(RECIPES[0], [f"{SCHEDULE}=fraction", f"{FRACTION}=0.25"])
    assert config.gsm.sparse_attention.top_k_fraction == 0.25


def test_layer_indices_checked_once_the_model_is_known() -> None:
    config = load_recipe(
        RECIPES[0],
        [
            "gsm.cross_layer_sharing.enabled=true",
            "gsm.sparse_attention.dense_layers=[0,9]",
            "gsm.sparse_attention.retrieval_layers=[2,12]",
            "gsm.kv_compression.enabled=true",
            "gsm.kv_compression.layer_bits={3: [2, 4], 8: [4, 4]}",
        ],
    )
    check_against_model(config, num_layers=30)
    with pytest.raises(ConfigError) as info:
        check_against_model(config, num_layers=8)
    assert sorted(p.path for p in info.value.problems) == [
        "gsm.cross_layer_sharing.bridge_to_start",
        "gsm.kv_compression.layer_bits.8",
        "gsm.sparse_attention.dense_layers.1",
        "gsm.sparse_attention.retrieval_layers.1",
    ]


def test_gsm_block_follows_the_seed_schema() -> None:
    assert set(GSMConfig.model_fields) == {"gsm_enabled", "sparse_attention", "kv_compression", "cross_layer_sharing"}


def test_unreadable_recipe_is_one_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_recipe(tmp_path / "missing.yaml")
    assert "cannot read the recipe" in str(info.value)


def test_fp32_matmul_takes_tf32_only_inside_training_on_cuda() -> None:
    """`train.fp32_matmul=tf32` turns TF32 on for CUDA inside the context and gives PyTorch's setting back
    after (also after an error); `default`, or a CPU device, leaves it alone; another value is refused."""
    from gsm_train.training.trainer import fp32_matmul_precision

    assert load_recipe(RECIPES[0], ["train.fp32_matmul=tf32"]).train.fp32_matmul == "tf32"
    with pytest.raises(ConfigError, match="train.fp32_matmul"):
        load_recipe(RECIPES[0], ["train.fp32_matmul=fp16"])
    matmul = torch.backends.cuda.matmul
    before = matmul.fp32_precision
    with pytest.raises(KeyError), fp32_matmul_precision("tf32", torch.device("cuda")):
        assert matmul.fp32_precision == "tf32"
        raise KeyError("a failing step")
    assert matmul.fp32_precision == before
    for precision, device in (("default", torch.device("cuda")), ("tf32", torch.device("cpu"))):
        with fp32_matmul_precision(precision, device):
            assert matmul.fp32_precision == before


def test_the_builtin_recipes_are_the_repo_recipes_and_resolve_by_name(tmp_path, monkeypatch):
    from gsm_train.config.builtin_recipes import builtin_recipes, resolve_recipe

    assert {name: path.resolve() for name, path in builtin_recipes().items()} == {p.stem: p.resolve() for p in RECIPES}
    monkeypatch.chdir(tmp_path)  # no recipes/ here: a bare name is the built-in one
    assert resolve_recipe("joint").resolve() == (REPO / "recipes" / "joint.yaml").resolve()

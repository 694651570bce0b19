"""The import table of docs/architecture.md, enforced: every `gsm_train` module's imports (those inside
functions and under `TYPE_CHECKING` included), parsed with `ast`, go only to its own folder or to a
folder of a lower layer; every file of the package belongs to a folder or leaf the table names."""

from __future__ import annotations

import ast
from pathlib import Path

import gsm_train

PACKAGE = Path(gsm_train.__file__).resolve().parent

# Bottom to top: a unit (a folder, or a flat module) may import its own unit and the units of lower layers.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "quant", "compiled", "durable", "plots", "assets"),  # leaves: import nothing from gsm_train
    ("kernels",),  # Triton / NVRTC kernels
    ("models",),  # base models: families, names, zoo, Hub ids, fingerprints
    ("config",),  # the recipe and GSM config schema, built-in recipes
    ("functional",),  # pure functions
    ("modules",),  # the nn.Modules
    ("attention",),  # how they run in a model
    ("inference",),  # the generation cache and engine
    ("tuning", "data"),  # a recipe resolved against a model; text and chat data
    ("export",),  # save/load, format, LoRA, card, Hub, GSMModel, int4
    ("training",),  # trainer, session, stages, backends, checkpoints, batches
    ("commands",),  # evaluate, generate, passkey, inspect
    ("entry",),  # what both entry points do around a command (exit codes, errors)
    ("train",),  # the entry point `python -m gsm_train.train` (what `gsm-train train` runs)
    ("cli",),  # the entry point `gsm-train`
    ("__init__",),  # the facade: lazily re-exports the public names
)
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
ROOT_NAMES = {"__version__"}  # the only names a module below the facade may take from `gsm_train` itself
SKIPPED = {"recipes"}  # gsm_train/recipes links to recipes/ (YAML only)


def unit_of(module: str) -> str:
    """`gsm_train.export.hub` -> `export`; `gsm_train` -> `__init__`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imported(module: str, is_package: bool, tree: ast.AST) -> list[tuple[str, str | None, int]]:
    """(target module, name taken from it or None, line) for every gsm_train import in `tree`."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "gsm_train"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] == "gsm_train":
                found += [(target, a.name, node.lineno) for a in node.names]
    return found


def forbidden_edges(module: str, source: str, is_package: bool = False) -> list[str]:
    """The imports of `module` (given as its source) that the table forbids, one line each."""
    own = unit_of(module)
    if own not in LAYER_OF:
        return [f"{module}: its folder or leaf `{own}` is not in the import table"]
    problems = []
    for target, name, line in _imported(module, is_package, ast.parse(source)):
        unit = unit_of(target)
        if unit == "__init__":  # `from gsm_train import X`: a submodule X, or a name of the facade
            if (PACKAGE / name).is_dir() or (PACKAGE / f"{name}.py").is_file():
                unit = name
            else:
                if own != "__init__" and name not in ROOT_NAMES:
                    problems.append(f"{module}:{line} takes {name!r} from the facade `gsm_train`")
                continue
        if unit == own:
            continue
        if unit not in LAYER_OF:
            problems.append(f"{module}:{line} imports {target}: `{unit}` is not in the import table")
        elif LAYER_OF[unit] >= LAYER_OF[own]:
            problems.append(f"{module}:{line} imports {target}: `{own}` may not import `{unit}` (same or higher layer)")
    return problems


def _modules() -> list[tuple[str, Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] in SKIPPED:
            continue
        parts = ("gsm_train", *rel.with_suffix("").parts)
        found.append((".".join(parts[:-1] if parts[-1] == "__init__" else parts), path))
    return found


def test_every_import_follows_the_table():
    problems = []
    for module, path in _modules():
        problems += forbidden_edges(module, path.read_text(), is_package=path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_every_file_of_the_package_is_in_the_table():
    units = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()}
    units -= SKIPPED | {"__pycache__"}
    units = {u for u in units if not u.endswith(".egg-info")}
    assert units == set(LAYER_OF)


def test_a_planted_import_running_up_is_caught():
    # inside a function, absolute: a kernel reaching up into training
    kernel = "def f():\n    from gsm_train.training.trainer import run_training\n"
    assert forbidden_edges("gsm_train.kernels.fake", kernel) == [
        "gsm_train.kernels.fake:2 imports gsm_train.training.trainer: `kernels` may not import `training` "
        "(same or higher layer)"
    ]
    # relative, and `import gsm_train.x`, and across one layer (tuning and data are peers)
    assert len(forbidden_edges("gsm_train.export.fake", "from ..commands import generate\n")) == 1
    assert len(forbidden_edges("gsm_train.data.fake", "import gsm_train.tuning.kv_budget\n")) == 1
    assert len(forbidden_edges("gsm_train.models.fake", "from gsm_train import GSMModel\n")) == 1
    assert len(forbidden_edges("gsm_train.models.fake", "from gsm_train import cli\n")) == 1
    assert len(forbidden_edges("gsm_train.newfolder.fake", "")) == 1
    # what the table allows: its own folder, lower layers, the version
    allowed = "from gsm_train import __version__\nfrom gsm_train.errors import GSMError\nfrom . import schema\n"
    assert forbidden_edges("gsm_train.config.fake", allowed) == []

"""The recipes shipped with the package (`gsm-train recipes list` / `copy`, like torchtune's `tune ls` /
`tune cp`), and recipe arguments that name one.

The recipes live once, in `recipes/` at the repository's root; `gsm_train/recipes` links to that folder,
so a wheel carries them as package data and a clone reads the same files. A recipe argument is a
file when such a file exists, else a built-in recipe's name (`gate_only`, or `gate_only.yaml`).
"""

from __future__ import annotations

import os
from pathlib import Path

RECIPES = Path(__file__).parent.parent / "recipes"  # gsm_train/recipes


def builtin_recipes() -> dict[str, Path]:
    """Name (the file name without `.yaml`) -> file of each built-in recipe, sorted by name."""
    return {path.stem: path for path in sorted(RECIPES.glob("*.yaml"))}


def recipe_summary(path: Path) -> str:
    """A recipe's first comment line, without the `#` (its one-line description), or ''."""
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.startswith("#"):
            return line.lstrip("#").strip()
        if line.strip():
            break
    return ""


def resolve_recipe(recipe: str | Path) -> Path:
    """The file a recipe argument names: the file itself when it exists, else the built-in recipe of
    that name (with or without `.yaml`); unchanged otherwise (reading it then fails with its path)."""
    path = Path(recipe)
    if path.exists() or path.parent != Path("."):
        return path
    return builtin_recipes().get(path.name.removesuffix(".yaml"), path)


def copy_recipe(name: str, destination: str | Path) -> Path:
    """Copy the built-in recipe `name` to `destination` (a file, or a folder, an existing one or a path
    ending in `/`, to put `NAME.yaml` in) and
    return the file written. Raises FileNotFoundError for an unknown name and FileExistsError rather
    than replace a file."""
    recipes = builtin_recipes()
    source = recipes.get(name.removesuffix(".yaml"))
    if source is None:
        raise FileNotFoundError(f"no built-in recipe {name!r}; the built-in recipes are {', '.join(recipes)}")
    target = Path(destination)
    if target.is_dir() or str(destination).endswith(("/", os.sep)):
        target = target / source.name
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        with target.open("xb") as handle:  # "x": fails rather than replace a file
            handle.write(source.read_bytes())
    except FileExistsError:
        raise FileExistsError(f"{target} exists; give another destination (a recipe is never overwritten)") from None
    return target

"""Helpers shared by test modules (a test module imports these, never another test module)."""

from __future__ import annotations

import ast
import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CODE = ("rlhf", "ablations", "pipelines", "benchmarks")


def copy_params(dest: Path, params: dict | None = None, text: str | None = None) -> Path:
    """``dest``/params.yaml: ``params`` dumped, or ``text``, or the repository's own file; returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    if params is not None:
        (dest / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    elif text is not None:
        (dest / "params.yaml").write_text(text)
    else:
        shutil.copy(REPO / "params.yaml", dest / "params.yaml")
    return dest


def tracked_files(prefixes: tuple[str, ...], names: tuple[str, ...] = ()) -> list[str]:
    """The repository's files git lists (tracked, or untracked and not ignored) under ``prefixes`` or named."""
    files = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.split()
    keep = lambda f: f.startswith(prefixes) or f in names
    return [f for f in files if keep(f) and (REPO / f).is_file()]  # a file may be deleted since git listed it


def copy_code(dest: Path, prefixes: tuple[str, ...] = tuple(f"{d}/" for d in CODE), names: tuple[str, ...] = ()):
    """Copies this checkout's files under ``prefixes`` (and those ``names``) into ``dest``."""
    for f in tracked_files(prefixes, names):
        (dest / f).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / f, dest / f)


PACKAGES = ("rlhf", "ablations", "pipelines")


def module_file(name: str) -> Path | None:
    """The repository file of module ``name`` (package -> its __init__.py), or None if it is not ours."""
    if name.split(".")[0] not in PACKAGES:
        return None
    base = REPO.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def imported_modules(path: Path, name: str) -> set[str]:
    """Names of the modules ``path`` (module ``name``) imports, including ``from pkg import submodule`` forms and
    the parent packages Python imports on the way."""
    out: set[str] = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
            out.add(base)
            out |= {f"{base}.{a.name}" for a in node.names}
    parents = {".".join(m.split(".")[:i]) for m in out for i in range(1, m.count(".") + 1)}
    return out | parents

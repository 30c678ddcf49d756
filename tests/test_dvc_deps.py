"""Every DVC stage declares every repository module it imports: a code change can never leave a cached result
silently stale.

For each stage of dvc.yaml (as DVC itself resolves it), the entry module of its `python -m <module>` command is
followed through every `import` statement anywhere in the file (function-level imports included) to the
modules of this repository it reaches; each must be covered by one of the stage's deps (the file itself or a
directory above it).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import PACKAGES, REPO, imported_modules, module_file


def import_closure(entry: str) -> set[Path]:
    """Repository files reached from module ``entry`` (itself and its parent packages included)."""
    seen: dict[str, Path] = {}
    todo = [entry] + [".".join(entry.split(".")[:i]) for i in range(1, entry.count(".") + 1)]
    while todo:
        name = todo.pop()
        path = module_file(name)
        if path is None or name in seen:
            continue
        seen[name] = path
        todo += imported_modules(path, name)
    return set(seen.values())


def stage_groups() -> list[tuple[str, str, list[Path]]]:
    """(name, cmd, deps) of one stage per dvc.yaml entry (a matrix group's stages share their cmd template and
    deps), as DVC resolves them. Resolved with the repository's params.yaml plus one exploratory coefficient and
    KL target per task and one packaged model: params.yaml leaves those lists empty, and DVC generates no stage
    from an empty matrix, so the exploratory and conversion groups would otherwise go unchecked."""
    import shutil
    import tempfile

    import yaml
    from dvc.repo import Repo

    from ablations.tasks import TASKS
    from tests.conftest import repo_params

    p = repo_params()
    for task in TASKS:
        p[task]["coefs"], p[task]["kl_targets"] = [0.1], [2.0]
        p[task]["allocation"] = dict.fromkeys(p[task]["allocation"], p[task]["instances"])  # every design group
    p["pretrained"] = ["smollm2-135m"]  # the packaged models' conversion stage (none by default)
    groups = {}
    with tempfile.TemporaryDirectory() as tmp:
        shutil.copy(REPO / "dvc.yaml", Path(tmp) / "dvc.yaml")
        (Path(tmp) / "params.yaml").write_text(yaml.safe_dump(p, sort_keys=False))
        Repo.init(tmp, no_scm=True)
        with Repo(tmp) as repo:
            for s in repo.index.stages:
                groups.setdefault(s.name.split("@")[0], (s.name, s.cmd, [Path(d.def_path) for d in s.deps]))
    return list(groups.values())


GROUPS = stage_groups()


def test_the_walker_follows_function_level_and_from_imports():
    closure = {p.relative_to(REPO).as_posix() for p in import_closure("pipelines.analysis")}
    assert {"pipelines/__init__.py", "pipelines/analysis.py", "ablations/config.py", "rlhf/config.py"} <= closure
    assert "ablations/plots.py" in closure  # imported inside a function of ablations/analysis.py


def test_every_dvc_yaml_entry_is_checked():
    import yaml

    entries = set(yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"])
    assert {name.split("@")[0] for name, _, _ in GROUPS} == entries


@pytest.mark.parametrize("name, cmd, deps", GROUPS, ids=lambda x: x.split("@")[0] if isinstance(x, str) else "")
def test_stage_deps_cover_its_import_closure(name, cmd, deps):
    words = cmd.split()
    assert "-m" in words, f"{name}: expected a `python -m <module>` command, got {cmd!r}"
    entry = words[words.index("-m") + 1]
    assert module_file(entry), f"{name}: {entry} is not a module of this repository"
    covered = [REPO / d for d in deps]
    missing = sorted(
        p.relative_to(REPO).as_posix()
        for p in import_closure(entry)
        if not any(p == c or c in p.parents for c in covered)
    )
    assert not missing, f"stage {name} imports modules it does not list in dvc.yaml deps: {', '.join(missing)}"


@pytest.mark.parametrize("name, cmd, deps", GROUPS, ids=lambda x: x.split("@")[0] if isinstance(x, str) else "")
def test_stage_deps_list_no_module_it_does_not_import(name, cmd, deps):
    """The other half of deps == import closure: a repository module (or package directory) in a stage's deps that
    the stage never imports would rerun its cells for nothing when that module changes."""
    words = cmd.split()
    closure = {p.relative_to(REPO).as_posix() for p in import_closure(words[words.index("-m") + 1])}
    extra = []
    for d in deps:
        path = d.as_posix()
        if path.split("/")[0] not in PACKAGES:
            continue
        if (REPO / d).is_dir():
            if not any(c.startswith(path.rstrip("/") + "/") for c in closure):
                extra.append(path)
        elif path.endswith(".py") and path not in closure:
            extra.append(path)
    assert not extra, f"stage {name} lists modules it never imports in dvc.yaml deps: {', '.join(extra)}"

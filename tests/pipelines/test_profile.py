"""Run profiles (pipelines/profile.py): merged into params.yaml, validated first, comments kept."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from ablations.config import ParamsError, load_params, read_yaml
from ablations.tasks import TASKS
from pipelines.profile import apply, main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(params_copy):
    (params_copy / "profiles").mkdir()
    return params_copy


def write(repo: Path, name: str, text: str) -> None:
    (repo / "profiles" / f"{name}.yaml").write_text(text)


def test_merge_adds_arms_replaces_lists_and_keeps_comments(repo):
    arm = "{target: reference, placement: loss, estimator: k2}"
    write(repo, "p", f"grid:\n  seeds: [0, 1]\n  arms:\n    extra_k2: {arm}\n")
    before = load_params(repo / "params.yaml")
    changed = apply("p", repo / "params.yaml", repo / "profiles")
    after = load_params(repo / "params.yaml")
    assert changed == ["grid.seeds", "grid.arms.extra_k2"]
    assert after.grid.seeds == [0, 1]
    assert set(after.grid.arms) == set(before.grid.arms) | {"extra_k2"}  # merged, not replaced
    assert after.grammar == before.grammar
    assert "# params.yaml: the one file to edit" in (repo / "params.yaml").read_text()
    assert apply("p", repo / "params.yaml", repo / "profiles") == []  # idempotent


def test_bad_value_names_the_key_and_writes_nothing(repo):
    write(repo, "bad", "grammar:\n  ppo:\n    algorithm: trpo\n")
    text = (repo / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"grammar\.ppo\.algorithm.*'ppo'") as e:
        apply("bad", repo / "params.yaml", repo / "profiles")
    assert "with profile bad" in str(e.value)
    assert (repo / "params.yaml").read_text() == text
    assert sorted(p.name for p in repo.iterdir()) == ["params.yaml", "profiles"]  # no temporary file left


def test_profile_may_not_change_the_protocol(repo):
    write(repo, "amend", "analysis:\n  alpha: 0.1\n")
    with pytest.raises(ParamsError, match="may not change 'analysis'"):
        apply("amend", repo / "params.yaml", repo / "profiles")


def test_unknown_profile_lists_the_known_ones(repo, capsys, monkeypatch):
    write(repo, "full", "grid:\n  seeds: [0]\n")
    with pytest.raises(ParamsError, match=r"no profile 'ful'.*profiles: full"):
        apply("ful", repo / "params.yaml", repo / "profiles")
    monkeypatch.chdir(repo)
    assert main(["ful"]) == 2
    assert "no profile 'ful'" in capsys.readouterr().err


@pytest.mark.parametrize("profile", sorted(p.stem for p in (ROOT / "profiles").glob("*.yaml")))
def test_shipped_profiles_apply_to_the_default_params(repo, profile):
    """Each applies and validates; a real-model profile without the real-model extra (`make test` installs none,
    `make test-all` does) is refused in one line that says how to install it, leaving params.yaml as it was."""
    from ablations.section import missing_extra

    shutil.copy(ROOT / "profiles" / f"{profile}.yaml", repo / "profiles")
    packaged = read_yaml(repo / "profiles" / f"{profile}.yaml").get("pretrained", [])
    if any(missing_extra(name) for name in packaged):
        text = (repo / "params.yaml").read_text()
        with pytest.raises(ParamsError, match=r"pretrained.*make install-real"):
            apply(profile, repo / "params.yaml", repo / "profiles")
        assert (repo / "params.yaml").read_text() == text
        return
    first = read_yaml(repo / "profiles" / f"{profile}.yaml").get("grammar", {}).get("instances")
    if profile == "first-look" and read_yaml(repo / "params.yaml")["grammar"]["instances"] == first:
        from pipelines.settle import extend  # params.yaml is the first look until `make settle` appends a batch

        extend("grammar", ["same_beta"], repo / "params.yaml")
    assert apply(profile, repo / "params.yaml", repo / "profiles")  # changes something, validates


def test_edit_with_no_change_leaves_params_yaml_byte_identical(repo):
    """edit() (make settle, profiles) rewrites params.yaml whole: with nothing changed, every byte must stay (it once
    turned `null` into an empty value and re-indented grid.design's list)."""
    from pipelines.profile import edit

    text = (repo / "params.yaml").read_text()
    assert edit(repo / "params.yaml", lambda doc: "result", "a no-op") == "result"
    assert (repo / "params.yaml").read_text() == text


def test_edit_that_breaks_validation_names_what_and_writes_nothing(repo):
    from pipelines.profile import edit

    text = (repo / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"^params\.yaml with a bad edit: .*instances"):
        edit(repo / "params.yaml", lambda doc: doc["grammar"]["instances"].append(100), "params.yaml with a bad edit")
    assert (repo / "params.yaml").read_text() == text
    assert sorted(p.name for p in repo.iterdir()) == ["params.yaml", "profiles"]


@pytest.mark.parametrize("name", ["../params", "/etc/hostname", "../../outside"])
def test_a_profile_outside_profiles_is_refused_and_nothing_is_written(repo, name):
    (repo.parent / "outside.yaml").write_text("grid:\n  seeds: [5]\n")
    before = (repo / "params.yaml").read_bytes()
    with pytest.raises(ParamsError, match=rf"^PROFILE '{name}': not a file in .*profiles/ \(it resolves to "):
        apply(name, repo / "params.yaml", repo / "profiles")
    assert (repo / "params.yaml").read_bytes() == before


@pytest.mark.parametrize("which", ["profile", "params.yaml"])
def test_non_utf8_profile_or_params_fails_in_one_line(repo, which):
    write(repo, "p", "grid:\n  seeds: [0, 1]\n")
    target = repo / "profiles" / "p.yaml" if which == "profile" else repo / "params.yaml"
    target.write_bytes(target.read_bytes() + b"# \xe9t\xe9\n")
    with pytest.raises(ParamsError, match=r"not UTF-8 text \(byte \d+ is 0xe9\); save it as UTF-8$") as err:
        apply("p", repo / "params.yaml", repo / "profiles")
    assert "\n" not in str(err.value) and str(target) in str(err.value)


def test_an_empty_profile_fails_in_one_line(repo):
    """Issue 30: an empty (or comments-only) profile gave an AttributeError traceback."""
    before = (repo / "params.yaml").read_bytes()
    for text in ("", "# nothing but a comment\n"):
        write(repo, "empty", text)
        with pytest.raises(ParamsError, match=r"empty.yaml: empty \(no key, only comments or nothing\)") as err:
            apply("empty", repo / "params.yaml", repo / "profiles")
        assert "\n" not in str(err.value)
    assert (repo / "params.yaml").read_bytes() == before


def test_an_edit_killed_before_its_rename_leaves_a_temporary_file_the_runner_removes(repo, monkeypatch):
    """Issue 30: the fixed-name .params.yaml.tmp of a killed edit was never cleaned (pipelines.leftovers)."""
    from pipelines import profile
    from pipelines.leftovers import clean_temp

    write(repo, "p", "grid:\n  seeds: [0, 1]\n")
    before = (repo / "params.yaml").read_bytes()

    def killed(src, dst):
        raise KeyboardInterrupt  # as a SIGINT between the validation and the rename

    monkeypatch.setattr(profile.os, "replace", killed)
    monkeypatch.setattr(profile.Path, "unlink", lambda *a, **k: None)  # a kill runs no cleanup
    with pytest.raises(KeyboardInterrupt):
        apply("p", repo / "params.yaml", repo / "profiles")
    monkeypatch.undo()
    left = [p.name for p in repo.iterdir() if p.name.startswith(".params.yaml")]
    assert len(left) == 1 and (repo / "params.yaml").read_bytes() == before
    assert [p.name for p in clean_temp(repo)] == left
    assert not [p for p in repo.iterdir() if p.name.startswith(".params.yaml")]


def test_a_profile_keeps_params_yaml_layout(repo):
    """A shorter one-line list stays on one line with its comment next to it (not a block list with the comment at
    column 131); new lists and arms are written on one line, as params.yaml writes them."""
    shutil.copy(ROOT / "profiles" / "variants.yaml", repo / "profiles")
    apply("variants", repo / "params.yaml", repo / "profiles")
    lines = (repo / "params.yaml").read_text().splitlines()
    inst = [line for line in lines if line.lstrip().startswith("instances: [100,")]
    profiled = yaml.safe_load((ROOT / "profiles" / "variants.yaml").read_text())
    assert len(inst) == sum("instances" in (profiled.get(t) or {}) for t in TASKS), inst  # the tasks it sets
    assert inst and all(line.index("# EVALUATION") < 60 for line in inst), inst
    assert "    loss_k3_is: {target: reference, placement: loss, estimator: k3, is_weight: true}" in lines
    assert "      at: [20, 40]" in lines and "  coefs: [0.1]  # exploratory fixed cells" in "\n".join(lines)
    assert not any(line.strip() == "- 100" for line in lines)


def test_reset_restores_params_reports_and_lock_from_the_last_commit(tmp_path, monkeypatch):
    from pipelines.profile import RESET_PATHS, reset

    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], check=True)
    for p in ("params.yaml", "dvc.lock", "reports/grammar/report.md"):
        (tmp_path / p).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / p).write_text(f"committed {p}\n")
    subprocess.run([*git, "add", "-A"], check=True)
    subprocess.run([*git, "commit", "-qm", "default"], check=True)
    for p in ("params.yaml", "dvc.lock", "reports/grammar/report.md"):
        (tmp_path / p).write_text("after a profile\n")
    (tmp_path / "notes.txt").write_text("mine\n")
    monkeypatch.setattr(sys, "executable", "true")  # `dvc checkout` stands in: no DVC repository here
    reset()
    for p in ("params.yaml", "dvc.lock", "reports/grammar/report.md"):
        assert (tmp_path / p).read_text() == f"committed {p}\n"
    assert (tmp_path / "notes.txt").read_text() == "mine\n"  # nothing else touched
    assert {"params.yaml", "dvc.lock", "reports"} <= set(RESET_PATHS)

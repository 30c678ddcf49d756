"""Run profiles (pipelines/profile.py): merged into params.yaml, validated first, comments kept."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ablations.config import ParamsError, load_params, read_yaml
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

"""Semantic validation before compute (issue 20, items 2-3): each value that used to pass the check and then broke a
stage (or ran and meant nothing) is refused by the runner before it writes any file, in one line naming the key."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from ablations.tasks import TASKS
from pipelines import run
from tests.pipelines.tiny import TINY

from ..conftest import repo_params

HF = {"family": None, "intermediate_size": None, "tokens": None, "bf16": False}
DIAGNOSTICS = {"at": [1], "n_true": 16, "n_minibatches": 2}


def metric(task: str, name: str) -> callable:
    return lambda p: p["analysis"]["tasks"][task]["metrics"].append(name)


def ppo(**values) -> callable:
    return lambda p: p["grammar"]["ppo"].update(values)


def arm(name: str, **values) -> callable:
    base = {"target": "reference", "placement": "loss", "estimator": "k3"}
    return lambda p: p["grid"]["arms"].update({name: {**base, **values}})


# (id, a change to the tiny grid's params (a function of the dict, or the YAML text itself), the one line's words)
CASES = [
    ("an unknown metric", metric("grammar", "goldd"), "analysis.tasks.grammar.metrics: task grammar has no metric"),
    ("a metric the task lacks", metric("grammar", "ood_gold"), "grammar has no metric 'ood_gold'"),
    (  # margins are calibrated: a share of the no-KL gain, at most all of it
        "a margin larger than the whole gain",
        lambda p: p["grammar"]["calibration"].update(margin_fraction=1e6),
        "grammar.calibration.margin_fraction: Input should be less than or equal to 1",
    ),
    ("eval_seed of 2**64", ppo(eval_seed=2**64), "grammar.ppo.eval_seed: must be in [0, 2147483647]"),
    ("diagnostics seed 1e14", ppo(diagnostics={**DIAGNOSTICS, "seed": 10**14}), "grammar.ppo.diagnostics: seed"),
    ("arm name of 240 characters", arm("a" * 240), "at most 64 characters"),
    ("missing_eos_score -1e308", ppo(missing_eos_score=-1e308), "grammar.ppo.missing_eos_score: must be in"),
    ("temperature 1e-300", ppo(temperature=1e-300), "grammar.ppo.temperature: must be in [0.01, 100]"),
    ("vf_coef 1e308", ppo(vf_coef=1e308), "grammar.ppo.vf_coef: must be in [0, 100]"),
    (  # a task runs with all three instance lists or none (then make repro skips it)
        "calibration and planning instances but no evaluation instances",
        lambda p: p["grammar"].update(instances=[]),
        "grammar: instances, calibration.instances and calibration.plan_instances must all be empty (the task does "
        "not run) or all non-empty",
    ),
    (
        "no instances at all",
        lambda p: [
            p[t].update(
                instances=[],
                calibration={**p[t]["calibration"], "instances": [], "plan_instances": []},
                allocation={g: [] for g in p[t]["allocation"]},
            )
            for t in p
            if t in TASKS
        ],
        f"no task runs: give at least one of {', '.join(TASKS)} instances",
    ),
    (
        "pretrained path that does not exist",
        lambda p: p["grammar"]["model"].update(backend="hf", hf={**HF, "pretrained": "../nonexistent-model"}),
        "grammar.model.hf.pretrained: '../nonexistent-model' does not exist",
    ),
    (
        "pretrained path that is not a model",
        lambda p: p["grammar"]["model"].update(backend="hf", hf={**HF, "pretrained": "/etc"}),
        "grammar.model.hf.pretrained: '/etc' has no config.json",
    ),
    (
        "eval_fraction 1e-9",
        lambda p: p["arithmetic"]["task"].update(eval_fraction=1e-9),
        "arithmetic.task: eval_fraction = 1e-09 leaves too few of the",
    ),
    (
        "rl_fraction 1e-9",
        lambda p: p["arithmetic"]["task"].update(rl_fraction=1e-9),
        "arithmetic.task: rl_fraction = 1e-09 leaves too few",
    ),
    (
        "SFT batch of a million",  # on the repository's model and sequence (the tiny grid's are ~30x smaller)
        lambda p: [
            p["grammar"]["model"].update(d_model=64, n_layers=2),
            p["grammar"]["task"].update(max_new_tokens=12),
            p["grammar"]["sft"].update(batch_size=1_000_000),
        ],
        "grammar: model x batch x sequence = 1.6e+12",
    ),
    (
        "a model of 65536 x 1000 layers",
        lambda p: p["grammar"]["model"].update(d_model=65536, n_layers=1000),
        "is above the limit 1e+12",
    ),
    ("eval_every above iterations", ppo(eval_every=5), "grammar.ppo: eval_every (5) must be <= iterations (4)"),
    (
        "ref_sync_every of 10**12",
        arm("moving", ref_sync_every=10**12, ref_sync_alpha=1.0),
        "grid.arms.moving.ref_sync_every (1000000000000) must be <= grammar.ppo.iterations (4)",
    ),
    ("%YAML 1.1 with seed 010", "%YAML 1.1\n---\nSEEDED", "1: '%YAML 1.1': no %YAML directive"),
    ("octal-looking seed", "SEEDED", "grid.seeds.1: '010': write the number without leading zeros"),
    ("vars section", lambda p: p.update(vars=[{"x": 1}]), "unknown key 'vars'; allowed: grammar"),
    ("an alias bomb", "TEXT\nbomb: &a [1, 1]\nbomb2: [*a, *a]\n", "bomb: no anchors or aliases"),
    ("non-UTF-8 params.yaml", b"\xff\xfe", "not UTF-8 text (byte 0 is 0xff); save it as UTF-8"),
]


def text_of(change) -> bytes:
    p = repo_params(TINY)
    if callable(change):
        change(p)
    p = json.loads(json.dumps(p))  # no shared objects (YAML anchors)
    text = yaml.safe_dump(p, sort_keys=False)
    if isinstance(change, bytes):
        return change
    if isinstance(change, str):
        seeded = text.replace("seeds:\n  - 0\n", "seeds: [0, 010]\n")
        assert seeded != text
        return change.replace("SEEDED", seeded).replace("TEXT", text).encode()
    return text.encode()


def files(root: Path) -> dict[str, float]:
    return {str(p.relative_to(root)): p.stat().st_mtime_ns for p in root.rglob("*")}


@pytest.mark.parametrize("what, change, words", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_file_is_written_in_one_line_naming_the_key(
    tmp_path, monkeypatch, capsys, what, change, words
):
    (tmp_path / "params.yaml").write_bytes(text_of(change))
    (tmp_path / ".dvc").mkdir()
    monkeypatch.chdir(tmp_path)
    before = files(tmp_path)
    assert run.main(["--workers", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: params.yaml:"), err
    assert words in err, err
    assert files(tmp_path) == before  # nothing written


def test_the_tiny_grid_itself_passes():
    from ablations.config import Params

    Params.model_validate(repo_params(TINY))

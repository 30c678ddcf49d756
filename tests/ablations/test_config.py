"""params.yaml validation: every kind of bad value fails before any compute, with one line naming the file, the key
and what is allowed; the check is torch-free and fast; params.yaml itself is complete (no competing defaults)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from ablations.config import Params, ParamsError, load_params

from ..conftest import REPO, repo_params


def check(tmp_path, params: dict | str) -> str:
    """The one-line error of loading ``params`` (a dict or raw YAML text) from tmp_path/params.yaml."""
    path = tmp_path / "params.yaml"
    unshared = params if isinstance(params, str) else json.loads(json.dumps(params))  # no YAML anchors
    path.write_text(unshared if isinstance(params, str) else yaml.safe_dump(unshared, sort_keys=False))
    with pytest.raises(ParamsError) as err:
        load_params(path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{path}:"), message
    return message.removeprefix(f"{path}:").removeprefix(" ")


def mutated(fn) -> dict:
    p = repo_params()
    fn(p)
    return p


BAD = [
    # (what, mutation, expected words in the message)
    (
        "misspelt placement",
        lambda p: p["grid"]["arms"]["reward_k1"].update(placement="rewrad"),
        "'reward', 'loss' or 'both'",
    ),
    (
        "unknown estimator",
        lambda p: p["grid"]["arms"]["loss_k3"].update(estimator="k4"),
        "'k1', 'k2', 'k3', 'full', 'k1+' or 'k3+'",
    ),
    ("negative coefficient", lambda p: p["grammar"].update(coefs=[-0.1]), "grammar.coefs"),
    ("infinite coefficient", lambda p: p["grammar"].update(coefs=[float("inf")]), "grammar.coefs.0"),
    ("NaN coefficient", lambda p: p["grammar"].update(coefs=[float("nan")]), "grammar.coefs.0"),
    ("no seeds", lambda p: p["grid"].update(seeds=[]), "grid.seeds"),
    ("duplicate instance", lambda p: p["grammar"].update(instances=[0, 0]), "duplicate instance 0"),
    ("negative KL target", lambda p: p["grammar"].update(kl_targets=[-1.0]), "grammar.kl_targets"),
    ("duplicate seed", lambda p: p["grid"].update(seeds=[1, 1]), "duplicate seed 1"),
    (
        "unknown key",
        lambda p: p["grammar"]["ppo"].update(learning_rate=1.0),
        "unknown key 'grammar.ppo.learning_rate'; allowed: algorithm, iterations",
    ),
    ("unknown section", lambda p: p.update(ppo2={}), "unknown key 'ppo2'; allowed: grammar, arithmetic, grid"),
    (
        "unknown arm key",
        lambda p: p["grid"]["arms"]["loss_k3"].update(estimatr="k3"),
        "unknown key 'grid.arms.loss_k3.estimatr'; allowed: target, placement, estimator, adaptive_target",
    ),
    (
        "placement none as an arm",
        lambda p: p["grid"]["arms"].update(bad={"target": "reference", "placement": "none", "estimator": "k1"}),
        "no-KL baseline",
    ),
    ("arm named none", lambda p: p["grid"]["arms"].update(none=p["grid"]["arms"]["loss_k3"]), "reserved"),
    ("arm named baseline", lambda p: p["grid"]["arms"].update(baseline=p["grid"]["arms"]["loss_k3"]), "reserved"),
    ("boolean iterations", lambda p: p["grammar"]["ppo"].update(iterations=True), "grammar.ppo.iterations"),
    ("boolean lr", lambda p: p["grammar"]["ppo"].update(lr=True), "grammar.ppo.lr"),
    ("absurd iterations", lambda p: p["grammar"]["ppo"].update(iterations=1_000_000_000_000), "grammar.ppo.iterations"),
    ("string number", lambda p: p["grammar"]["ppo"].update(lr="0.001"), "grammar.ppo.lr"),
    ("held-out larger than demos", lambda p: p["grammar"]["task"].update(n_demos=500), "sft.n_heldout"),
    ("one held-out pair", lambda p: p["grammar"]["rm"].update(n_heldout_pairs=1), "grammar.rm.n_heldout_pairs"),
    ("empty experiment", lambda p: p["mlflow"].update(experiment=""), "mlflow.experiment"),
    ("missing key", lambda p: p["grammar"]["ppo"].pop("lr"), "missing key 'grammar.ppo.lr'"),
    ("kl in ppo", lambda p: p["grammar"]["ppo"].update(kl={}), "belong in 'grid'"),
    ("minibatch does not divide", lambda p: p["grammar"]["ppo"].update(minibatch_size=7), "multiple of minibatch_size"),
    ("reference arm not an arm", lambda p: p["analysis"].update(reference_arm="nope"), "allowed: reward_k1"),
    (
        "adaptive arm without a horizon",
        lambda p: p["grid"]["arms"].update(
            adaptive={"target": "reference", "placement": "loss", "estimator": "k3", "adaptive_target": 2.0}
        ),
        "grid.arms.adaptive: adaptive_target and horizon go together",
    ),
]


@pytest.mark.parametrize("what, mutate, words", BAD, ids=[b[0] for b in BAD])
def test_bad_values_fail_with_one_line_naming_the_key(tmp_path, what, mutate, words):
    assert words in check(tmp_path, mutated(mutate))


def test_duplicate_yaml_key_is_refused_with_its_line(tmp_path):
    text = yaml.safe_dump(repo_params(), sort_keys=False).replace("mlflow:\n", "mlflow:\n  experiment: a\n", 1)
    assert "duplicate key" in check(tmp_path, text)


def test_yaml_syntax_error_names_the_file_and_line(tmp_path):
    message = check(tmp_path, "task: {seed: 0\nmodel: [")
    assert message.startswith("2:") or message.startswith("3:"), message
    assert "invalid YAML" in message


def test_params_yaml_is_complete_and_valid():
    """The repository's params.yaml declares every field (the schema has no defaults to fall back on)."""
    params = load_params(REPO / "params.yaml")
    for name, section in params:
        if hasattr(section, "model_fields_set") and name != "ppo":
            assert section.model_fields_set >= {k for k, f in type(section).model_fields.items() if f.is_required()}
    assert all(f.is_required() for f in Params.model_fields.values())


def test_check_is_torch_free_and_fast():
    code = (
        "import sys, time; t = time.perf_counter(); import ablations.config as c; c.load_params(); "
        "assert 'torch' not in sys.modules, 'torch imported'; print(time.perf_counter() - t)"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 5.0  # imports included; about 0.2 s on the development machine

"""params.yaml validation: every kind of bad value fails before any compute, with one line naming the file, the key
and what is allowed; the check is torch-free and fast; params.yaml itself is complete (no competing defaults)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from ablations.config import Params, ParamsError, load_params
from ablations.tasks import TASKS
from rlhf.config import ESTIMATORS

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
        ", ".join(map(repr, ESTIMATORS[:-1])) + f" or {ESTIMATORS[-1]!r}",  # pydantic's words for rlhf.config's list
    ),
    ("negative coefficient", lambda p: p["grammar"].update(coefs=[-0.1]), "grammar.coefs"),
    ("infinite coefficient", lambda p: p["grammar"].update(coefs=[float("inf")]), "grammar.coefs.0: must be finite"),
    ("NaN coefficient", lambda p: p["grammar"].update(coefs=[float("nan")]), "grammar.coefs.0: must be finite"),
    ("infinite KL target", lambda p: p["grammar"].update(kl_targets=[-float("inf")]), "kl_targets.0: must be finite"),
    ("no seeds", lambda p: p["grid"].update(seeds=[]), "grid.seeds"),
    ("duplicate instance", lambda p: p["grammar"].update(instances=[0, 0]), "duplicate instance 0"),
    ("negative KL target", lambda p: p["grammar"].update(kl_targets=[-1.0]), "grammar.kl_targets"),
    ("duplicate seed", lambda p: p["grid"].update(seeds=[1, 1]), "duplicate seed 1"),
    (
        "unknown key",
        lambda p: p["grammar"]["ppo"].update(learning_rate=1.0),
        "unknown key 'grammar.ppo.learning_rate'; allowed: algorithm, iterations",
    ),
    ("unknown section", lambda p: p.update(ppo2={}), f"unknown key 'ppo2'; allowed: {', '.join(TASKS)}, grid"),
    (
        "unknown arm key",
        lambda p: p["grid"]["arms"]["loss_k3"].update(estimatr="k3"),
        "unknown key 'grid.arms.loss_k3.estimatr'; allowed: target, placement, estimator, is_weight",
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
    # protocol v4: calibration and planning instances, calibration rules, the design groups and their allocation
    ("calibration coefs too few", lambda p: p["grammar"]["calibration"].update(coefs=[0.1, 0.3]), "at least 3"),
    (
        "calibration coef written twice, as an int and a float",  # one value, two DVC stage names
        lambda p: p["grammar"]["calibration"].update(coefs=[0.1, 1, 1.0]),
        "duplicate coefficient 1",
    ),
    (
        "calibration coef duplicate",
        lambda p: p["grammar"]["calibration"].update(coefs=[0.1, 0.3, 0.1]),
        "duplicate coefficient 0.1",
    ),
    ("calibration coef zero", lambda p: p["grammar"]["calibration"].update(coefs=[0.0, 0.1, 0.3]), "(0, 1000]"),
    (
        "duplicate calibration instance",
        lambda p: p["grammar"]["calibration"].update(instances=[0, 0]),
        "grammar.calibration.instances: duplicate instance 0",
    ),
    (
        "duplicate planning instance",
        lambda p: p["grammar"]["calibration"].update(plan_instances=[3, 3]),
        "grammar.calibration.plan_instances: duplicate plan instance 3",
    ),
    (
        "a planning instance that is a calibration instance",
        lambda p: p["grammar"]["calibration"].update(plan_instances=[2, 3]),
        "instances and plan_instances must be disjoint (both have [2])",
    ),
    (
        "a planning instance that is an evaluation instance",
        lambda p: p["grammar"]["calibration"].update(plan_instances=[3, 124]),
        "nothing is judged on an instance it was tuned or planned on (both have [124])",
    ),
    ("no margin", lambda p: p["grammar"]["calibration"].update(margin_fraction=0.0), "calibration.margin_fraction"),
    ("unknown gain", lambda p: p["grammar"]["calibration"].update(gain="mean"), "grammar.calibration.gain"),
    ("acts below one margin", lambda p: p["grammar"]["calibration"].update(acts=0.5), "grammar.calibration.acts"),
    ("no log-KL margin", lambda p: p["grammar"]["calibration"].update(log_kl_fraction=0.0), "log_kl_fraction"),
    (
        "levels not increasing",
        lambda p: p["grammar"]["calibration"].update(levels=[0.5, 0.25, 0.125]),
        "grammar.calibration.levels: must list at least 3 increasing fractions in (0, 1)",
    ),
    (
        "a level at the no-KL runs' own KL",
        lambda p: p["grammar"]["calibration"].update(levels=[0.25, 0.5, 1.0]),
        "increasing fractions in (0, 1)",
    ),
    (
        "tasks with different numbers of levels",
        lambda p: p["arithmetic"]["calibration"].update(levels=[0.1, 0.2, 0.3, 0.4]),
        "every task's calibration.levels must have the same length (got [3, 4])",
    ),
    ("missing calibration", lambda p: p["arithmetic"].pop("calibration"), "missing key 'arithmetic.calibration'"),
    (
        "calibration instances without evaluation instances",
        lambda p: p["grammar"].update(instances=[]),
        "must all be empty (the task does not run) or all non-empty (got 0, 3 and 8)",
    ),
    (
        "evaluation instances without calibration instances",
        lambda p: p["arithmetic"]["calibration"].update(instances=[]),
        "must all be empty",
    ),
    (
        "evaluation instances without planning instances",
        lambda p: p["arithmetic"]["calibration"].update(plan_instances=[]),
        "calibration.plan_instances must all be empty (the task does not run) or all non-empty (got ",
    ),
    ("calibration arm not an arm", lambda p: p["grid"].update(calibration_arms=["reward_k1", "nope"]), "'nope'"),
    ("duplicate calibration arm", lambda p: p["grid"].update(calibration_arms=["reward_k1"] * 2), "duplicate"),
    (
        "reference arm not calibrated",
        lambda p: (
            p["grid"].update(calibration_arms=["loss_k3"]),
            p["grid"]["design"]["camps"].remove("reward_k1-tuned"),
        ),
        "grid.calibration_arms must include the reference arm 'reward_k1'",
    ),
    ("unknown role", lambda p: p["grid"]["design"]["checks"].append("loss_k1-best"), "must be '<arm>-<role>'"),
    ("unknown design arm", lambda p: p["grid"]["design"]["checks"].append("nope-act"), "must be '<arm>-<role>'"),
    (
        "duplicate design cell, in two groups",
        lambda p: p["grid"]["design"]["camps"].append("loss_k1-act"),
        "grid: duplicate design cell loss_k1-act",
    ),
    (
        "tuned arm not calibrated",
        lambda p: p["grid"]["design"]["camps"].append("reward_k3-tuned"),
        "grid.design.camps: 'reward_k3-tuned' is tuned on calibration, so reward_k3 must be a calibration arm",
    ),
    (
        "a level the calibration does not fix",
        lambda p: p["grid"]["design"]["frontier"].append("loss_k3-level4"),
        "grid.design: loss_k3-level4: grammar has 3 calibration.levels (level1..3)",
    ),
    (
        "no shared group",
        lambda p: p["grid"]["design"].update(everywhere=p["grid"]["design"].pop("shared")),
        "grid.design must have a 'shared' group",
    ),
    (
        "a design group's name that is no identifier",
        lambda p: p["grid"]["design"].update({"Same-Beta": ["reward_k3-tuned"]}),
        "group name 'Same-Beta' must match",
    ),
    (
        "no positive control in the shared group",
        lambda p: p["grid"]["design"]["shared"].remove("reward_k1-control"),
        "grid.design.shared must include 'reward_k1-control'",
    ),
    (
        "the control in another group than the shared one",
        lambda p: (
            p["grid"]["design"]["shared"].remove("reward_k1-act"),
            p["grid"]["design"]["same_beta"].append("reward_k1-act"),
        ),
        "grid.design.shared must include 'reward_k1-act' (the controls of every question)",
    ),
    (
        "primary cell not in the design",
        lambda p: p["grid"]["design"]["frontier"].remove("loss_k3-level2"),
        "analysis.primary.frontier: needs the design cell 'loss_k3-level2'",
    ),
    (
        "check cell not in the design",
        lambda p: p["grid"]["design"]["checks"].remove("loss_k1-act"),
        "analysis.checks.k1_in_loss: needs the design cell 'loss_k1-act'",
    ),
    (
        "a design group without its allocation",
        lambda p: p["grammar"]["allocation"].pop("camps"),
        "grammar.allocation must give every design group but 'shared' its instances",
    ),
    (
        "an allocation that is not the first instances",
        lambda p: p["grammar"]["allocation"].update(camps=[125, 126]),
        "allocation.camps must be the first instances of 'instances', in order (got [125, 126]",
    ),
    (
        "instances not whole batches",
        lambda p: p["grammar"]["instances"].append(p["grammar"]["instances"][-1] + 1),  # one past a whole batch
        "instances must be whole batches",
    ),
    (
        "exploratory KL target written twice, as an int and a float",
        lambda p: p["grammar"].update(kl_targets=[2, 2.0]),
        "duplicate KL target 2",
    ),
    (
        "an arm's strength is the grid's (coefs, kl_targets), not the arm's",
        lambda p: p["grid"]["arms"].update(
            adaptive={"target": "reference", "placement": "loss", "estimator": "k3", "adaptive_target": 2.0}
        ),
        "unknown key 'grid.arms.adaptive.adaptive_target'; allowed: target, placement, estimator",
    ),
    # issue 18: combinations with no sound meaning, refused before any compute with the keys named
    (
        "exact KL in the reward alone",
        lambda p: p["grid"]["arms"]["reward_k1"].update(estimator="full"),
        "grid.arms.reward_k1: estimator 'full' with placement 'reward'",
    ),
    (
        "return_to_go in both places",
        lambda p: p["grid"]["arms"]["reward_k1"].update(placement="both", return_to_go=True),
        "grid.arms.reward_k1: return_to_go is a loss-side term",
    ),
    (
        "both_split",
        lambda p: p["grid"]["arms"]["reward_k1"].update(placement="both", both_split=0.5),
        "grid.arms.reward_k1: both_split is refused",
    ),
    (
        "GSPO misspelt",
        lambda p: p["grid"]["arms"]["loss_k3"].update(ratio_level="seq"),
        "'token' or 'sequence'",
    ),
    (
        "dr_grpo under ppo",
        lambda p: p["grid"]["arms"]["loss_k3"].update(dr_grpo=True),
        "grid.arms.loss_k3: dr_grpo changes GRPO's advantages: algorithm 'grpo'",
    ),
    (
        "old-policy forward KL with k3",
        lambda p: p["grid"]["arms"]["loss_k3"].update(target="old_policy_forward"),
        "placement 'loss', estimator 'full', return_to_go false",
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


@pytest.mark.parametrize("task", ["grammar", "arithmetic"])
def test_an_evaluation_instance_can_never_be_a_calibration_instance(tmp_path, task):
    """Nothing is judged on an instance it was tuned on: params.yaml that lists a task seed both as a calibration
    and as an evaluation instance is refused, naming the seed."""
    p = repo_params()
    cal = p[task]["calibration"]["instances"]
    p[task]["instances"] = [cal[-1], *p[task]["instances"][1:]]
    message = check(tmp_path, p)
    assert "must be disjoint" in message and f"(both have [{cal[-1]}])" in message
    params = load_params(REPO / "params.yaml")
    for section in params.tasks().values():
        assert not set(section.instances) & set(section.calibration.instances)


def test_a_task_with_no_instances_does_not_run_and_needs_no_protocol(tmp_path):
    p = repo_params()
    p["arithmetic"]["instances"], p["arithmetic"]["calibration"]["instances"] = [], []
    p["arithmetic"]["calibration"]["plan_instances"] = []
    p["arithmetic"]["allocation"] = {g: [] for g in p["arithmetic"]["allocation"]}
    del p["analysis"]["tasks"]["arithmetic"]
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(p, sort_keys=False))
    assert list(load_params(path).tasks()) == [t for t in TASKS if t != "arithmetic"]


def test_exploratory_cells_may_be_empty():
    params = load_params(REPO / "params.yaml")
    assert params.grammar.coefs == [] and params.grammar.kl_targets == []  # the design alone runs by default
    assert params.grid.design_cells()[0] == ("shared", "reward_k1", "act")


@pytest.mark.parametrize(
    "text, words",
    [
        ("", "empty (no key, only comments or nothing)"),
        ("# only a comment\n\n", "empty (no key, only comments or nothing)"),
        ("grid: " + "[" * 3000 + "]" * 3000 + "\n", "nested too deeply"),
        ("grid: " + "{a: " * 3000 + "1" + "}" * 3000 + "\n", "nested too deeply"),
    ],
    ids=["empty", "comments only", "3000-deep list", "3000-deep mapping"],
)
def test_a_file_that_is_not_params_fails_in_one_line(tmp_path, text, words):
    """Issue 30: these gave tracebacks (AttributeError from the anchors check, RecursionError)."""
    assert words in check(tmp_path, text)

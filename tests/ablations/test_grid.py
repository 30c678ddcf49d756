"""The runner's stage names are DVC's: for every spelling of a value params.yaml accepts, the cells of
ablations.grid name exactly the stages DVC generates from dvc.yaml (calibration cells, design cells, exploratory
cells, plan cells, the upstream chains of calibration, planning and evaluation instances, the calibrate, planning
and analysis stages), and values that would make them disagree are refused before any compute. Design and plan
cells have no KL config until the calibrated protocol resolves them."""

from __future__ import annotations

import shutil

import pytest
import yaml

from ablations.config import SHARED, ParamsError, load_params
from ablations.grid import (
    calibrate_stages,
    calibration_cells,
    cells,
    evaluation_cells,
    matrix_key,
    plan_cells,
    plan_stages,
    resolve,
    role_value,
    stage_name,
    upstream_chains,
    upstream_stages,
)
from ablations.tasks import TASKS

from ..conftest import REPO, repo_params

# Spellings YAML 1.2 (DVC's parser) reads as floats or ints, including the ones where two parsers disagree.
COEF_SPELLINGS = ["0.1", "1.0", "1e-05", "1.0e-2", ".5", "0.30000000000000004", "2.50", "1000.0", "+0.25", "3E-3"]
COEF_SPELLINGS += ["3", "+7"]  # ints: DVC names them 3 and 7, and so does the runner
TARGET_SPELLINGS = ["3", "9.0", "20.0", "1e1", "+4", "0.5"]  # ints and floats alike (issue 20)
SEED_SPELLINGS = ["0", "7", "2147483647", "+3"]  # not 010: octal-looking ints are refused (YAML 1.1 reads 8)


def dvc_stage_names(tmp_path, params_text: str) -> set[str]:
    from dvc.repo import Repo

    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")
    (tmp_path / "params.yaml").write_text(params_text)
    Repo.init(str(tmp_path), no_scm=True)
    with Repo(str(tmp_path)) as repo:
        return {s.name for s in repo.index.stages}


def params_text(coefs: list[str], seeds: list[str], targets: list[str] = (), calibration: list[str] = ()) -> str:
    """The repository's params.yaml with these (exploratory) coefficients, seeds, KL targets and calibration
    coefficients (default: the repository's) written verbatim."""
    p = repo_params()
    p["grammar"]["coefs"], p["grid"]["seeds"] = "COEFS", "SEEDS"
    if targets:
        p["grammar"]["kl_targets"] = "TARGETS"
    if calibration:
        p["grammar"]["calibration"]["coefs"] = "CALCOEFS"
    text = yaml.safe_dump(p, sort_keys=False)
    for key, values in (("CALCOEFS", calibration), ("COEFS", coefs), ("SEEDS", seeds), ("TARGETS", targets)):
        text = text.replace(key, "[" + ", ".join(values) + "]")
    return text


def test_matrix_key_is_dvc_to_str():
    from dvc.parsing.interpolate import to_str

    for value in (0.1, 1.0, 1e-05, 3, 0, True, False, "reward_k1", 0.30000000000000004):
        assert matrix_key(value) == to_str(value)
    assert stage_name("ppo", "loss_k3", 0.1, 2) == "ppo@loss_k3-0.1-2"


def test_runner_and_dvc_agree_on_every_accepted_spelling(tmp_path):
    """Every cell the runner knows is a stage of DVC's, and every other DVC stage is an upstream stage of a
    calibration, planning or evaluation instance, a calibrate, planning or analysis stage, for the stage groups
    ablations.grid names (a design group's own stage group on the planning and on the evaluation instances)."""
    text = params_text(COEF_SPELLINGS, SEED_SPELLINGS, TARGET_SPELLINGS, COEF_SPELLINGS)
    (tmp_path / "check.yaml").write_text(text)
    params = load_params(tmp_path / "check.yaml")
    ours = {c.stage for c in cells(params)}
    theirs = dvc_stage_names(tmp_path, text)
    assert ours <= theirs, sorted(ours - theirs)[:5]
    upstream = set()
    for prefix, spec in TASKS.items():
        kinds = ("data", "sft", "rm", "eval0") if spec.learned_reward else ("data", "sft", "eval0")
        section = getattr(params, prefix)
        upstream |= {f"{prefix}_{s}@{i}" for s in kinds for i in section.instances}
        upstream |= {f"{prefix}_calibration_{s}@{i}" for s in kinds for i in section.calibration.instances}
        upstream |= {f"{prefix}_plan_{s}@{i}" for s in kinds for i in section.calibration.plan_instances}
    assert {s for chain in upstream_chains(params) for s in chain} == upstream
    assert theirs - ours == upstream | {f"{t}_{k}" for t in TASKS for k in ("calibrate", "planning", "analysis")}
    assert calibrate_stages(params) == [f"{t}_calibrate" for t in TASKS]
    assert plan_stages(params) == [f"{t}_planning" for t in TASKS]
    assert {s.split("@")[0] for s in upstream} == set(upstream_stages(params)) | {
        f"{t}_{p}{k}"
        for t in TASKS
        for p in ("", "calibration_", "plan_")
        for k in ("data", "sft", "rm")
        if k != "rm" or TASKS[t].learned_reward
    }
    groups = [g for g in params.grid.design if g != SHARED]
    kinds = {c.group for c in cells(params)}
    allocated = lambda t: [g for g in groups if getattr(params, t).allocation[g]]  # `checks`: planning only
    assert kinds == {f"{t}_{k}" for t in params.tasks() for k in
                     ("calibration_baseline", "calibration", "plan_baseline", "plan", "baseline", "design",
                      *(f"plan_{g}" for g in groups), *(f"design_{g}" for g in allocated(t)))} | {
                         "grammar_fixed", "grammar_matched"}  # fmt: skip


def test_upstream_chains_run_calibration_then_planning_instances_first_in_stage_order():
    params = load_params(REPO / "params.yaml")
    chains = upstream_chains(params)
    g = params.grammar
    first = [stage_name(f"grammar_calibration_{k}", g.calibration.instances[0]) for k in ("data", "sft", "rm", "eval0")]
    assert chains[0] == first
    index = lambda prefix: [i for i, c in enumerate(chains) if c[0].startswith(f"grammar_{prefix}data@")]
    assert max(index("calibration_")) < min(index("plan_")) < max(index("plan_")) < min(index(""))
    only = upstream_chains(params, evaluation=False)
    assert only and all(("calibration_" in s) != ("plan_" in s) for c in only for s in c)
    assert len(chains) - len(only) == sum(len(t.instances) for t in params.tasks().values())


def calibrated_protocol() -> dict:
    return {"coef": 0.1, "control_coef": 0.03, "tuned": {"reward_k1": 0.1, "loss_k3": 0.3}, "levels": [1.5, 3.0, 6.0]}


def test_design_and_plan_cells_have_no_kl_until_resolved_against_the_protocol():
    """The grid (and every stage name) is known before the calibration has run: design and plan cells carry no KL
    config, no coefficient and no target; resolve() fills them in from the calibrated protocol, role by role (act,
    control, tuned: a coefficient; level<k>: steered to the k-th KL level), and leaves every other cell as it is.
    The planning instances run every design entry; the evaluation instances those of the groups allocated there."""
    params = load_params(REPO / "params.yaml")
    design = [c for c in evaluation_cells(params) if c.kind == "design"]
    plan = [c for c in plan_cells(params) if c.kind == "plan"]
    assert design and plan and all(c.kl is None and c.coef is None and c.kl_target is None for c in design + plan)
    roled = ("design", "plan")
    every = calibration_cells(params) + plan_cells(params) + evaluation_cells(params)
    assert all(c.kl is not None for c in every if c.kind not in roled)
    assert {(c.design_group, c.arm, c.role) for c in plan} == set(params.grid.design_cells())
    allocated = {(g, a, r) for g, a, r in params.grid.design_cells() if g == SHARED or params.grammar.allocation[g]}
    assert {(c.design_group, c.arm, c.role) for c in design if c.task == "grammar"} == allocated
    proto, m = calibrated_protocol(), params.grid.matched
    for c in design + plan:
        r = resolve(c, params, proto)
        assert r.stage == c.stage and r.out_dir == c.out_dir  # the name does not depend on the calibration
        spec = params.grid.arms[c.arm]
        assert (r.kl.placement, r.kl.estimator, r.kl.is_weight) == (spec.placement, spec.estimator, spec.is_weight)
        if c.role.startswith("level"):
            level = proto["levels"][int(c.role[5:]) - 1]
            assert (r.kl.adaptive_target, r.kl.horizon, r.kl.coef) == (level, m.horizon, m.init_coef)
            assert r.kl_target == level and r.result_kind == "matched"
        else:
            want = {"act": 0.1, "control": 0.03, "tuned": proto["tuned"].get(c.arm)}[c.role]
            assert r.kl.coef == r.coef == want and r.kl.adaptive_target is None and r.result_kind == "fixed"
    base = next(c for c in evaluation_cells(params) if c.kind == "baseline")
    assert resolve(base, params, proto) is base
    assert role_value(proto, "loss_k3", "tuned") == 0.3 and role_value(proto, "reward_k1", "control") == 0.03
    assert role_value(proto, "loss_k3", "level2") == 3.0


def test_no_evaluation_cell_runs_on_a_calibration_or_planning_instance():
    params = load_params(REPO / "params.yaml")
    for task, section in params.tasks().items():
        cal = {c.instance for c in calibration_cells(params) if c.task == task}
        plan = {c.instance for c in plan_cells(params) if c.task == task}
        ev = {c.instance for c in evaluation_cells(params) if c.task == task}
        assert cal == set(section.calibration.instances) and ev == set(section.instances)
        assert plan == set(section.calibration.plan_instances)
        assert not cal & ev and not plan & ev and not cal & plan
    assert all(c.calibration and not c.plan for c in calibration_cells(params))
    assert all(c.plan and not c.calibration for c in plan_cells(params))
    assert not any(c.calibration or c.plan for c in evaluation_cells(params))


@pytest.mark.parametrize(
    "coefs, seeds, message",
    [
        (["1", "1.0"], ["0"], "duplicate coefficient 1"),  # two names (…-1-…, …-1.0-…), one value
        (["0.1"], ["1.0"], "grid.seeds.0"),  # a float seed
        (["0.1"], ["true"], "grid.seeds.0"),  # a boolean seed
        (["true"], ["0"], "grammar.coefs.0"),  # a boolean coefficient
        (["0.1", "1e-1"], ["0"], "duplicate coefficient"),  # two spellings, one value, one stage name
        (["0.1"], ["1", "+1"], "duplicate seed 1"),
        (["0.1"], ["010"], "grid.seeds.0: '010': write the number without leading zeros"),
        ([".inf"], ["0"], "grammar.coefs.0"),
        ([".nan"], ["0"], "grammar.coefs.0"),
        (["0.1"], ["-1"], "grid.seeds.0"),
    ],
)
def test_values_that_would_disagree_or_mislead_are_refused(tmp_path, coefs, seeds, message):
    path = tmp_path / "params.yaml"
    path.write_text(params_text(coefs, seeds))
    with pytest.raises(ParamsError, match=message) as err:
        load_params(path)
    assert "\n" not in str(err.value)

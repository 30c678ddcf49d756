"""The tiny grid of the end-to-end tests: its params, its stage names, and a git + DVC repository that runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from ablations.tasks import TASKS
from tests.conftest import repo_params
from tests.helpers import copy_code

REPO = Path(__file__).resolve().parents[2]
GROUPS = ("same_beta", "same_gradient", "frontier", "frontier_reward", "camps")  # params.yaml's design groups


TINY = {
    "grammar": {
        "instances": [10, 11],  # evaluation instances: one batch of analysis.sequential.batch_size
        "allocation": {g: [10, 11] for g in GROUPS} | {"checks": []},
        # disjoint from the evaluation instances
        "calibration": {"instances": [0], "plan_instances": [1, 2], "coefs": [0.03, 0.1, 0.3]},
        "coefs": [],
        "kl_targets": [],
        "task": {
            "n_words": 8,
            "n_successors": 3,
            "max_new_tokens": 6,
            "n_demos": 700,
            "n_train_prompts": 64,
            "n_eval_prompts": 32,
        },
        "model": {"d_model": 16, "n_layers": 1, "n_heads": 2},
        "sft": {"steps": 30, "batch_size": 32, "n_heldout": 100},
        "rm": {"n_pairs": 64, "n_heldout_pairs": 32, "steps": 20, "batch_size": 16},
        # lr 0.01: the no-KL runs gain gold within 4 iterations (the calibration needs a gain to scale margins by)
        "ppo": {"iterations": 4, "batch_size": 8, "minibatch_size": 4, "epochs": 1, "eval_every": 1, "lr": 0.01},
    },
    "grid": {
        "arms": {
            "reward_k1": {"target": "reference", "placement": "reward", "estimator": "k1"},
            "loss_k1": {"target": "reference", "placement": "loss", "estimator": "k1"},
            "reward_k3": {"target": "reference", "placement": "reward", "estimator": "k3"},
            "loss_k3": {"target": "reference", "placement": "loss", "estimator": "k3"},
            "loss_k3_isrtg": {
                "target": "reference",
                "placement": "loss",
                "estimator": "k3",
                "is_weight": True,
                "return_to_go": True,
            },
        },
        "seeds": [0],
        "matched": {"init_coef": 0.1, "horizon": 100},
        "calibration_arms": ["reward_k1", "loss_k3"],
    },
    # At this size arithmetic's no-KL runs gain no accuracy, so its calibration would refuse (no margin scale): it
    # and every other task but grammar do not run here (tests/ablations cover arithmetic's protocol;
    # test_hf_pipeline runs its stages).
    **{
        t: {
            "instances": [],
            "allocation": {g: [] for g in (*GROUPS, "checks")},
            "calibration": {"instances": [], "plan_instances": []},
            "coefs": [],
            "kl_targets": [],
        }
        for t in TASKS
        if t != "grammar"
    },
    "analysis": {"reference_arm": "reward_k1", "sequential": {"batch_size": 2, "max_cap": 4, "simulations": 200}},
    "mlflow": {"experiment": "e2e"},
}


ARMS = ("reward_k1", "loss_k1", "reward_k3", "loss_k3", "loss_k3_isrtg")


CAL_ARMS = ("reward_k1", "loss_k3")


# params.yaml's design, by group: the shared group and every group allocated evaluation instances run on 10 and 11
# (TINY's allocation), every group on the planning instances 1 and 2
DESIGN_GROUPS = {g: tuple(cells) for g, cells in repo_params(TINY)["grid"]["design"].items()}
DESIGN = tuple(e for cells in DESIGN_GROUPS.values() for e in cells)  # 14 entries
EVALUATED = tuple(g for g in DESIGN_GROUPS if g == "shared" or TINY["grammar"]["allocation"][g])


def _group(task: str, kind: str, group: str) -> str:
    return f"{task}_{kind}" if group == "shared" else f"{task}_{kind}_{group}"


def calibration_stages(instances=(0,), task="grammar") -> set[str]:
    out = set()
    for i in instances:
        out |= {f"{task}_calibration_baseline@{i}-0"}
        out |= {f"{task}_calibration@{i}-{a}-{c}-0" for a in CAL_ARMS for c in (0.03, 0.1, 0.3)}
    return out


def plan_stages(instances=(1, 2), task="grammar") -> set[str]:
    """The planning cells of these instances: the no-KL baseline and every design entry of every group."""
    out = set()
    for i in instances:
        out |= {f"{task}_plan_baseline@{i}-0"}
        out |= {f"{_group(task, 'plan', g)}@{i}-{e}-0" for g, cells in DESIGN_GROUPS.items() for e in cells}
    return out


def cell_stages(instances=(10, 11), task="grammar") -> set[str]:
    """The evaluation cells of these instances: the no-KL baseline and every design cell of the groups that run
    there."""
    out = set()
    for i in instances:
        out |= {f"{task}_baseline@{i}-0"}
        out |= {f"{_group(task, 'design', g)}@{i}-{e}-0" for g in EVALUATED for e in DESIGN_GROUPS[g]}
    return out


CAL_CELLS = calibration_stages()  # 7


PLAN_CELLS = plan_stages()  # 2 x (1 + 14)


ALL_CELLS = CAL_CELLS | PLAN_CELLS | cell_stages()  # 7 + 30 + 2 x (1 + 13)


def stage_env(repo: Path) -> dict:
    """DVC runs stage commands as `python ...`: put this interpreter first on PATH."""
    return {
        **os.environ,
        "TQDM_DISABLE": "1",
        "MLFLOW_TRACKING_URI": f"sqlite:///{repo / 'mlflow.db'}",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }


def sh(repo: Path, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    env = stage_env(repo)
    out = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    if check and out.returncode:
        raise AssertionError(f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out


def write_params(repo: Path, params: dict) -> None:
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))


def visible_runs(repo: Path, experiment: str = "e2e") -> dict[str, list]:
    """The current MLflow runs of ``repo`` by DVC stage (superseded runs, sweep and task group runs left out)."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{repo / 'mlflow.db'}")
    exp = client.get_experiment_by_name(experiment)
    runs: dict[str, list] = {}
    for r in client.search_runs([exp.experiment_id], max_results=1000):
        if "dvc_stage" in r.data.tags and "superseded" not in r.data.tags:  # a stage's current run
            runs.setdefault(r.data.tags["dvc_stage"], []).append(r)
    return runs


def drop_idle_tasks(repo: Path, params: dict) -> None:
    """Removes from ``repo``'s dvc.yaml the stages of every task with no instances. Needed because dvc.yaml's
    ``<task>_calibrate`` and ``<task>_analysis`` are plain (not matrix) stages: they exist even for a task that does
    not run, and a plain `dvc repro` then fails on their missing inputs (runs/<task>/calibration_baseline)."""
    idle = [t for t in TASKS if not params[t]["instances"]]
    if not idle:
        return
    doc = yaml.safe_load((repo / "dvc.yaml").read_text())  # merge keys resolved
    doc["stages"] = {k: v for k, v in doc["stages"].items() if not k.startswith(tuple(f"{t}_" for t in idle))}
    doc["plots"] = [p for p in doc.get("plots", []) if not next(iter(p)).startswith(tuple(f"{t}_" for t in idle))]
    (repo / "dvc.yaml").write_text(yaml.safe_dump(doc, sort_keys=False, width=4096))


def make_repo(repo: Path, params: dict) -> Path:
    """A git + DVC repository in ``repo`` with this one's code (rlhf, ablations, pipelines, dvc.yaml) and ``params``."""
    code = ("rlhf/", "pipelines/", "ablations/", ".dvc/config", ".dvc/plots/", ".dvcignore")
    copy_code(repo, code, names=("dvc.yaml", ".gitignore"))
    write_params(repo, params)
    drop_idle_tasks(repo, params)
    sh(repo, "git", "init", "-q")
    sh(repo, sys.executable, "-m", "dvc", "init", "-q", "--force")  # empties .dvc/config: this checkout's again
    copy_code(repo, (), names=(".dvc/config",))  # analytics off, the travelling remote dvc-remote/ the default
    return repo

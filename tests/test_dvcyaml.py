"""dvc.yaml is rendered from pipelines/dvcyaml.py's stage templates over the registered tasks: the committed file
must be its rendering (a stale one fails here, and `python -m pipelines.dvcyaml --check` says so in one line)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

from ablations.tasks import TASKS
from pipelines import dvcyaml
from tests.helpers import REPO


def test_committed_dvc_yaml_is_its_rendering():
    assert (REPO / "dvc.yaml").read_text(encoding="utf-8") == dvcyaml.render(), "run `python -m pipelines.dvcyaml`"


def test_every_registered_task_has_its_stages_and_rm_stages_only_with_a_reward_model():
    stages = yaml.safe_load(dvcyaml.render())["stages"]
    for task, spec in TASKS.items():
        assert {f"{task}_{k}" for k in dvcyaml.STAGES if k not in dvcyaml.RM_KINDS} <= set(stages)
        assert {f"{task}_{k}" in stages for k in dvcyaml.RM_KINDS} == {spec.learned_reward}
        rm_deps = [d for s, e in stages.items() if s.startswith(f"{task}_") for d in e.get("deps", []) if "rm.pt" in d]
        assert bool(rm_deps) == spec.learned_reward
        for g in dvcyaml.design_groups()[1:]:  # every design group's own stages, on the planning and evaluation
            assert {f"{task}_plan_{g}", f"{task}_design_{g}"} <= set(stages)
    groups = len(dvcyaml.design_groups())  # the design and plan templates: one stage per group each
    per_task = lambda s: len(dvcyaml.STAGES) - len(dvcyaml.RM_KINDS) * (not s.learned_reward) + 2 * (groups - 1)
    assert len(stages) == 1 + sum(per_task(s) for s in TASKS.values())
    assert stages["pretrained"]["matrix"] == {"name": "${pretrained}"}  # the one stage not per task


def test_check_refuses_a_stale_file_in_one_line(tmp_path):
    cmd = [sys.executable, "-m", "pipelines.dvcyaml", "--check"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)  # no params.yaml to render from
    assert out.returncode == 1 and out.stderr == "error: params.yaml: cannot read: No such file or directory\n"
    shutil.copy(REPO / "params.yaml", tmp_path / "params.yaml")  # dvc.yaml's stage names hold its design groups
    (tmp_path / "dvc.yaml").write_text(dvcyaml.render() + "# edited by hand\n")
    out = subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 1 and out.stderr.count("\n") == 1 and "python -m pipelines.dvcyaml" in out.stderr
    (tmp_path / "dvc.yaml").write_text(dvcyaml.render())
    assert subprocess.run(cmd, cwd=tmp_path, capture_output=True, env=env).returncode == 0

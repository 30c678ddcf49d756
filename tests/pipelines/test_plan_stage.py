"""The `<task>_planning` stage (pipelines/plan.py): reads the calibrated protocol and the plan cells of params.yaml,
writes protocol/<task>.plan.json (each primary comparison's cap); refuses in one line without them. On synthetic
planning runs (tests/ablations/synthetic.py) at the paths the grid gives the plan cells."""

from __future__ import annotations

import json

import pytest

from ablations.config import load_params
from ablations.grid import plan_cells, plan_path, protocol_path
from pipelines import plan
from tests.ablations import synthetic as syn


def protocol(root) -> dict:
    cal = {k: v for k, v in syn.calibrated("grammar").items() if k not in ("frozen", "plan", "plan_frozen")}
    (root / "protocol").mkdir(exist_ok=True)
    protocol_path("grammar").write_text(json.dumps(cal))
    return cal


def test_the_stage_writes_every_comparisons_cap_from_the_plan_cells(params_copy):
    protocol(params_copy)
    expected = syn.write_plan_runs(params_copy)
    grid = {c.stage: c.out_dir for c in plan_cells(load_params()) if c.task == "grammar"}
    assert {r.stage: r.path for r in expected} == grid  # the synthetic runs lie where the grid reads them
    out = plan.main(["grammar"])
    written = json.loads(plan_path("grammar").read_text())
    assert written == json.loads(json.dumps(out))
    assert set(written["comparisons"]) == set(syn.comparison_names())  # (written with sorted keys)
    assert all(c["cap"] % 4 == 0 and c["cap"] <= written["rule"]["max_cap"] for c in written["comparisons"].values())
    assert sorted(p.name for p in (params_copy / "protocol").iterdir()) == ["grammar.json", "grammar.plan.json"]


def test_without_the_protocol_or_the_plan_cells_it_refuses_in_one_line(params_copy):
    with pytest.raises(SystemExit) as e:
        plan.main(["grammar"])
    assert str(e.value.code) == "error: protocol/grammar.json not found: run the calibration first (dvc repro " \
        "grammar_calibrate)"  # fmt: skip
    protocol(params_copy)
    with pytest.raises(SystemExit) as e:
        plan.main(["grammar"])
    msg = str(e.value.code)
    assert msg.startswith("error: grammar_planning needs every plan run;") and "\n" not in msg, msg
    assert "grammar_plan_baseline@3-0" in msg and not plan_path("grammar").exists()
    with pytest.raises(SystemExit) as e:
        plan.main(["nope"])
    assert "usage: python -m pipelines.plan <task>; allowed: grammar, arithmetic" in str(e.value.code)

"""The gradient-diagnostic table, figure and stats of a task's report, on synthetic run directories
(tests/ablations/synthetic.py plants diagnostics.csv files) and on hand-made rows."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from scipy import stats

from ablations import analysis as A
from ablations import diagnostics as G
from ablations import tables as T
from ablations.load import DIAGNOSTIC_COLUMNS, MissingResultsError, load_diagnostics, load_runs
from rlhf.config import PPOConfig

from . import synthetic as syn

PROTO = syn.protocol()
IN = syn.inputs()
PLANTED = {a: syn.THEORY[a] for a in ("reward_k1", "loss_k1", "loss_k3")}  # reward_k3: diagnostics off
# exploratory cells besides the design's, and every design group (loss_k1 is in `checks`)
SMALL = dict(coefs=(0.03, 0.3), targets=(8.0,), design=syn.DESIGN)
# KL-arm runs per instance: exploratory 5 arms x (2 coefs + 1 target) + 14 design cells
KL_RUNS = 12 * (len(syn.ARMS) * 3 + len(syn.DESIGN))
ROLES = {"fixed": ("act", "control", "tuned"), "matched": ("level1", "level2", "level3")}


def _files(root, arm: str, kind: str) -> list:
    """diagnostics.csv of ``arm``'s runs of ``kind``: its exploratory folder and its design cells of that kind."""
    files = list((root / "runs/grammar" / kind).glob(f"*-{arm}-*-*/diagnostics.csv"))
    for role in ROLES[kind]:
        files += (root / "runs/grammar/design").glob(f"*-{arm}-{role}-*/diagnostics.csv")
    return sorted(files)


def _independent(root, arm: str, regime: str, metric: str, kind: str = "fixed") -> tuple[np.ndarray, int, int]:
    """Per-instance means read straight from the files (glob, not the loader), and the number of runs and rows."""
    by_instance, runs, rows = {}, 0, 0
    for f in _files(root, arm, kind):
        d = pd.read_csv(f)
        if d.empty:  # header-only
            continue
        d = d[d.regime == regime]
        runs, rows = runs + 1, rows + len(d)
        by_instance.setdefault(int(f.parent.name.split("-")[0]), []).extend(d[metric])
    return np.array([np.mean(v) for _, v in sorted(by_instance.items())]), runs, rows


def test_table_aggregates_the_planted_rows_per_instance(tmp_path):
    """Only fixed runs of the planted arms carry diagnostics (exploratory and design; matched runs and reward_k3
    are header-only, and so is one loss_k1 run, which leaves instance 0 with fewer rows than the others): the
    table has exactly the planted arm x regime rows, and each number is the mean over instances of the
    per-instance means over runs and checkpoints (not the mean over rows), with the t CI at 1 - alpha and
    n = instances."""
    exp = syn.write_runs(tmp_path, diagnostics=PLANTED, diag_kinds=("fixed",), **SMALL)
    (tmp_path / "runs/grammar/fixed/0-loss_k1-0.03-0/diagnostics.csv").write_text("iteration,regime\n")
    tr = A.analyse(PROTO, exp, tmp_path, **IN).tasks["grammar"]
    t = tr.diagnostic_table
    assert list(zip(t.arm, t.regime)) == [
        (a, r) for a in ("reward_k1", "loss_k1", "loss_k3") for r in ("on_policy", "off_policy")
    ]  # reward-side k1 first, loss-side k1 next to it; on-policy before off-policy
    for r in t.itertuples():
        for m in ("cosine", "scale", "rel_bias", "rel_var"):
            v, runs, rows = _independent(tmp_path, r.arm, r.regime, m)
            assert getattr(r, f"{m}_mean") == pytest.approx(v.mean())
            half = stats.t.ppf(0.975, len(v) - 1) * v.std(ddof=1) / math.sqrt(len(v))
            assert (getattr(r, f"{m}_lo"), getattr(r, f"{m}_hi")) == pytest.approx((v.mean() - half, v.mean() + half))
            assert getattr(r, f"{m}_n") == len(v) == 12
        # fixed runs per instance: reward_k1 2 + act + control + tuned, loss_k1 2 + act, loss_k3 2 + act + tuned
        per = {"reward_k1": 5, "loss_k1": 3, "loss_k3": 4}[r.arm]
        want = 12 * per - (r.arm == "loss_k1")
        assert (r.runs, r.rows, r.instances) == (runs, rows, 12) == (want, 2 * want, 12)
        assert r.updates == (0 if r.regime == "on_policy" else syn.DIAG_UPDATES) and r.checkpoints == [20, 40]
    by = t.set_index(["arm", "regime"])
    assert by.loc[("loss_k1", "on_policy"), "scale_hi"] < 0.1 < by.loc[("reward_k1", "on_policy"), "scale_lo"]
    cov = tr.diagnostic_coverage
    assert (cov["runs_with"], cov["runs_total"]) == (12 * 12 - 1, KL_RUNS)
    control = syn.calibrated()["control_coef"]
    assert cov["cells"] == [("fixed", control), ("fixed", 0.03), ("fixed", 0.1), ("fixed", 0.3)]
    assert cov["checkpoints"] == [20, 40]


def test_header_only_and_absent_files_are_skipped_and_a_broken_one_is_named(tmp_path):
    exp = syn.write_runs(tmp_path, diagnostics={"loss_k1": syn.THEORY["loss_k1"]}, diag_absent=True, **SMALL)
    runs, _ = load_runs(exp, tmp_path)
    d = load_diagnostics(runs, tmp_path)
    # instances x (2 fixed + 1 matched + the design's act cell) x checkpoint x regime
    assert set(d.arm) == {"loss_k1"} and len(d) == 12 * 4 * 2 * 2
    assert list(d.columns[-len(DIAGNOSTIC_COLUMNS) :]) == list(DIAGNOSTIC_COLUMNS)
    header_only = next(r for r in exp if "loss_k1" in r.stage)
    (tmp_path / header_only.path / "diagnostics.csv").write_text("iteration,regime\n")
    assert len(load_diagnostics(runs, tmp_path)) == len(d) - 4
    broken = next(r for r in exp if "loss_k1" in r.stage and r is not header_only)
    f = tmp_path / broken.path / "diagnostics.csv"
    f.write_text(pd.read_csv(f).drop(columns="scale").to_csv(index=False))
    with pytest.raises(MissingResultsError, match=rf"{broken.stage}.*lacks scale"):
        load_diagnostics(runs, tmp_path)


def _rows(arm: str, instance: int, regime: str = "on_policy", **metrics) -> dict:
    base = dict.fromkeys(G.METRICS, 0.5) | metrics
    return dict(task="grammar", kind="fixed", instance=instance, seed=0, arm=arm, level=0.1,
                stage=f"s-{arm}-{instance}", iteration=10, regime=regime, updates=0, **base)  # fmt: skip


def test_order_follows_the_spec_and_nan_cosines_are_left_out():
    """Sorted by algorithm, target, estimator (straight-through after its base), placement, variants off first; a
    cosine that is NaN (a zero estimate) is left out of its instance's mean and of n."""
    specs = {
        "grpo_reward_k1": ("grpo", "reference", "reward", "k1", False),
        "loss_k3_plus": ("ppo", "reference", "loss", "k3+", False),
        "both_k3": ("ppo", "reference", "both", "k3", False),
        "loss_k3_is": ("ppo", "reference", "loss", "k3", True),
        "loss_k3": ("ppo", "reference", "loss", "k3", False),
        "old_loss_k1": ("ppo", "old_policy", "loss", "k1", False),
        "loss_k1": ("ppo", "reference", "loss", "k1", False),
        "reward_k1": ("ppo", "reference", "reward", "k1", False),
    }
    cols = ("algorithm", "target", "placement", "estimator", "is_weight")
    config = lambda sp: PPOConfig.model_validate(syn.config(sp, 0.1, None, 0))  # the typed config load_runs reads
    runs = pd.DataFrame([{"arm": a, "config": config(dict(zip(cols, s)))} for a, s in specs.items()])
    rows = [_rows(a, i) for a in specs for i in range(3) if a != "old_loss_k1"]
    rows += [_rows("old_loss_k1", i, cosine=math.nan, cosine_minibatch=math.nan) for i in range(3)]
    rows += [_rows("loss_k1", i, "off_policy", cosine=[0.2, math.nan, 0.4][i]) for i in range(3)]
    t = G.table(pd.DataFrame(rows), runs, 0.95)
    assert list(t.arm) == ["reward_k1", "loss_k1", "loss_k1", "loss_k3", "loss_k3_is", "both_k3", "loss_k3_plus",
                           "old_loss_k1", "grpo_reward_k1"]  # fmt: skip
    off = t[(t.arm == "loss_k1") & (t.regime == "off_policy")].iloc[0]
    assert (off.cosine_n, off.cosine_mean, off.instances) == (2, pytest.approx(0.3), 3)
    old = t[t.arm == "old_loss_k1"].iloc[0]
    assert old.cosine_n == 0 and np.isnan(old.cosine_mean) and old.scale_n == 3
    md = T.diagnostics_table(t)
    assert "– (estimate 0)" in md and "0.300 [" in md and "(n 2)" in md
    assert "IS weight" in md and "algorithm" in md  # varying spec fields are columns
    varying, common = T.diagnostic_spec(t)
    assert "is_weight" in varying and common == ""


def test_report_stats_and_figure_with_diagnostics(tmp_path):
    exp = syn.write_runs(tmp_path, diagnostics=PLANTED, **SMALL)
    written = A.run(PROTO, exp, tmp_path / "out", tmp_path, task="grammar", **IN)
    names = [p.relative_to(tmp_path / "out").as_posix() for p in written]
    assert names == [*A.TASK_OUTPUTS[:-1], A.DIAGNOSTICS_FIGURE, "report.md"]
    assert all(p.is_file() and p.stat().st_size > 0 for p in written)
    report = (tmp_path / "out/report.md").read_text()
    section = report.split("## Gradient diagnostics")[1].split("\n## ")[0]
    lines = [x for x in section.splitlines() if x.startswith("| ")]
    assert lines[0].startswith("| arm ") and "rel. bias" in lines[0] and "noise floor" in lines[0]
    assert [x.split("|")[1].strip() for x in lines[1:]] == ["reward_k1", "reward_k1", "loss_k1", "loss_k1",
                                                           "loss_k3", "loss_k3"]  # fmt: skip
    assert "off-policy (7 updates)" in section and "checkpoint iteration(s) 20, 40" in section
    # per instance: reward_k1 3 + act + control + tuned + 3 levels, loss_k1 3 + act, loss_k3 3 + act + tuned + 3
    # levels = 21 of 29
    assert f"252 of the {KL_RUNS} KL-arm runs" in section and "96 KL-arm run(s) have no diagnostics" in section
    assert "Common to every row: algorithm ppo, group 1, target reference." in section
    assert "![Gradient diagnostics](figures/diagnostics.png)" in report
    st = json.loads((tmp_path / "out/stats.json").read_text())["gradient_diagnostics"]
    pooled = [_independent(tmp_path, "loss_k1", "off_policy", "cosine", kind) for kind in ("fixed", "matched")]
    per_instance = (pooled[0][0] * 3 + pooled[1][0]) / 4  # 3 fixed + 1 matched run, 2 checkpoints each
    assert st["rows"]["loss_k1/off_policy"]["cosine"]["mean"] == pytest.approx(per_instance.mean())
    assert st["rows"]["loss_k1/off_policy"]["updates"] == syn.DIAG_UPDATES and len(st["rows"]) == 6
    assert st["runs_with"] == 252 and st["checkpoints"] == [20, 40]


@pytest.mark.parametrize("absent", [False, True])
def test_runs_without_any_diagnostics_still_report(tmp_path, absent):
    """Header-only files (diagnostics off) or none at all (older runs): one line, no table, no figure."""
    exp = syn.write_runs(tmp_path, diag_absent=absent, **SMALL)
    written = A.run(PROTO, exp, tmp_path / "out", tmp_path, task="grammar", **IN)
    assert [p.relative_to(tmp_path / "out").as_posix() for p in written] == list(A.TASK_OUTPUTS)
    assert not (tmp_path / "out/figures/diagnostics.png").exists()
    report = (tmp_path / "out/report.md").read_text()
    section = report.split("## Gradient diagnostics")[1].split("\n## ")[0]
    assert "No run of this task has gradient diagnostics" in section and "| arm" not in section
    assert "Gradient diagnostics](" not in report
    st = json.loads((tmp_path / "out/stats.json").read_text())
    assert st["gradient_diagnostics"] == {"runs_with": 0, "rows": {}} and st["headline"]


def test_loader_columns_are_what_the_library_writes():
    """DIAGNOSTIC_COLUMNS must stay the keys of rlhf.diagnostics.gradient_diagnostics' rows, in their order."""
    import torch

    from rlhf.diagnostics import compare

    row = {"iteration": 1, "regime": "on_policy", "updates": 0, "strength": 1.0, "against": "reference",
           **compare(torch.randn(3, 5), torch.randn(5), 0.1)}  # fmt: skip
    assert tuple(row) == DIAGNOSTIC_COLUMNS
    assert set(G.METRICS) <= set(row)

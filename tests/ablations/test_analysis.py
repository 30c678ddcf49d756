"""End-to-end test of the analysis stage on fake run directories with a planted effect."""

import json
import re
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml

from ablations import analysis as A
from ablations.config import load_params
from ablations.grid import BASELINE, cells
from pipelines import analysis as stage

from ..conftest import repo_params

ARMS = {
    "reward_k1": {"target": "reference", "placement": "reward", "estimator": "k1"},
    "loss_k1": {"target": "reference", "placement": "loss", "estimator": "k1"},
}
COEFS = [0.05, 0.2]
SEEDS = [0, 1, 2, 3, 4]
PLANTED = 0.3  # loss_k1 earns this much more gold than reward_k1 at every KL
ITERS = np.arange(0, 45, 5)


def write_params(path, margin=0.05):
    path.write_text(
        yaml.safe_dump(
            repo_params(
                {
                    "grammar": {"instances": SEEDS},
                    "grid": {"arms": ARMS, "coefs": COEFS, "seeds": [0]},
                    "analysis": {
                        "metric": "final_gold",
                        "reference_arm": "reward_k1",
                        "margin": margin,
                        "alpha": 0.05,
                        "power": 0.8,
                        "kl_budgets": [2.0, 4.0, 8.0],
                    },
                }
            )
        )
    )
    return load_params(path)


def fake_runs(root, params, effect=PLANTED):
    """One run per cell: KL grows to a level set by arm and coef (baseline fastest), gold is an
    over-optimisation curve of KL plus the arm's offset, a per-seed effect shared by all arms, and noise."""
    seed_effect = np.random.default_rng(99).normal(0, 0.05, len(SEEDS))
    for i, cell in enumerate(c for c in cells(params) if c.kind != "matched"):
        rng = np.random.default_rng(i)
        scale = 12.0 if cell.arm == "loss_k1" else 10.0
        final_kl = 20.0 if cell.arm == BASELINE else scale * (0.05 / cell.coef) ** 0.5
        kl = final_kl * (ITERS / ITERS[-1]) ** 1.2 * rng.uniform(0.95, 1.05, len(ITERS))
        kl[0] = 0.0
        offset = effect if cell.arm == "loss_k1" else 0.0
        gold = (
            0.2
            + 0.12 * kl
            - 0.005 * kl**2
            + offset * (kl > 0)
            + seed_effect[cell.instance]
            + rng.normal(0, 0.01, len(kl))
        )
        d = root / cell.out_dir
        d.mkdir(parents=True)
        ev = pd.DataFrame(
            {
                "iteration": ITERS,
                "gold": gold,
                "proxy": gold + 0.1 * kl,
                "kl": kl,
                "entropy": 1.0,
                "length": 8.0,
                "illegal": 0.01,
            }
        )
        ev.to_csv(d / "evals.csv", index=False)
        pd.DataFrame(
            {
                "iteration": ITERS,
                "kl_coef": cell.coef,
                "kl_reward": 0.0,
                "pg_loss": 0.0,
                "vf_loss": 0.0,
                "clipfrac": 0.0,
                "approxkl": 0.0,
                "kl_loss": 0.0,
                "score": 0.0,
                "gold_train": gold,
                "length": 8.0,
            }
        ).to_csv(d / "history.csv", index=False)
        (d / "summary.json").write_text(
            json.dumps(
                {
                    "stage": cell.stage,
                    "arm": cell.arm,
                    "coef": cell.coef,
                    "seed": cell.seed,
                    "instance": cell.instance,
                    "target": cell.kl.target,
                    "placement": cell.kl.placement,
                    "estimator": cell.kl.estimator,
                    "adaptive_target": None,
                    "final_gold": gold[-1],
                    "final_proxy": gold[-1] + 1,
                    "final_kl": kl[-1],
                    "final_sqrt_kl": kl[-1] ** 0.5,
                    "final_entropy": 1.0,
                    "final_length": 8.0,
                    "final_illegal": 0.01,
                    "peak_gold": gold.max(),
                    "peak_gold_iteration": int(ITERS[gold.argmax()]),
                    "wall_s": 1.0,
                }
            )
        )


def stale_dirs(root):
    """Directories of cells that are not in the grid (a removed arm, coefficient and seed), full of nonsense."""
    for d in (
        root / "runs/grammar/fixed/0-loss_k2-0.05-0",
        root / "runs/grammar/fixed/0-loss_k1-0.5-0",
        root / "runs/grammar/baseline/9-0",
    ):
        d.mkdir(parents=True)
        (d / "summary.json").write_text(
            json.dumps({"arm": "loss_k2", "coef": 9.0, "instance": 9, "final_gold": -99.0, "final_kl": 99.0})
        )
        pd.DataFrame({"iteration": [0, 5], "gold": [-99.0, -99.0], "kl": [0.0, 99.0]}).to_csv(d / "evals.csv")


@pytest.fixture
def grid(tmp_path):
    params = write_params(tmp_path / "params.yaml")
    fake_runs(tmp_path, params)
    stale_dirs(tmp_path)
    return tmp_path, params


def test_whole_analysis_reports_the_planted_difference(grid):
    root, params = grid
    written = stage.main("grammar", root / "params.yaml", root / "reports", root)
    out = root / "reports"
    assert sorted(written) == sorted(out / f for f in A.OUTPUTS)
    assert all(f.is_file() and f.stat().st_size > 0 for f in written)
    assert not [p for p in root.iterdir() if p.name.startswith(".reports-tmp")]  # the temporary folder is gone

    report = (out / "report.md").read_text()
    answer = report.split("\n\n")[1]
    assert answer.startswith("**Answer (matters).** Yes")
    assert "loss_k1" in answer and "difference" in answer
    for name in ("figures/gold_vs_kl.png", "figures/learning_curves.png", "figures/forest.png"):
        assert f"]({name})" in report
    assert "synthetic task" in report and "±0.05" in report

    comp = pd.read_csv(out / "comparisons.csv")
    assert len(comp) == 2 * 2 + 3 * 2 + 2  # coefs x (loss_k1, none) + budgets x 2 + frontier x 2
    assert set(comp.arm) == {"loss_k1", BASELINE} and (comp.n_arm == 5).all()
    planted = comp[(comp.arm == "loss_k1") & (comp.family == "kl")]
    assert (planted.verdict == "difference").all()
    assert np.allclose(planted["diff"], PLANTED, atol=0.03)  # matched KL recovers the planted gap
    assert (comp[comp.family == "frontier"].query("arm == 'loss_k1'").verdict == "difference").all()

    stats = json.loads((out / "stats.json").read_text())
    assert stats["headline"] == "matters" and stats["verdicts"]["kl"]["difference"] >= 3
    assert stats["n_runs"] == len([c for c in cells(params) if c.kind != "matched"]) == 25
    assert not any("loss_k2" in k or "0.5" in k for k in stats["final_gold"])  # stale cells were ignored
    assert -99.0 not in pd.read_csv(out / "runs.csv").final_gold.to_list()


def test_no_effect_with_a_loose_margin_does_not_matter(tmp_path):
    params = write_params(tmp_path / "params.yaml", margin=1.0)
    fake_runs(tmp_path, params, effect=0.0)
    res = A.analyse(params, tmp_path)
    assert res.headline == "does not matter"
    kl = res.comparisons[(res.comparisons.family == "kl") & (res.comparisons.arm == "loss_k1")]
    assert (kl.verdict == "equivalent").all()
    assert res.answer.startswith("No, not beyond ±1 gold")


def test_missing_cell_names_the_stage_and_writes_nothing(grid):
    root, _params = grid
    (root / "runs/grammar/fixed/3-loss_k1-0.2-0/summary.json").unlink()
    shutil.rmtree(root / "runs/grammar/baseline/2-0")
    with pytest.raises(A.MissingResultsError) as e:
        stage.main("grammar", root / "params.yaml", root / "reports", root)
    assert "grammar_fixed@3-loss_k1-0.2-0" in str(e.value) and "grammar_baseline@2-0" in str(e.value)
    assert not (root / "reports" / "report.md").exists()


def test_results_of_another_cell_are_refused(grid):
    root, params = grid
    s = root / "runs/grammar/fixed/1-reward_k1-0.05-0/summary.json"
    s.write_text(s.read_text().replace('"instance": 1', '"instance": 4'))
    with pytest.raises(A.MissingResultsError, match=re.escape("grammar_fixed@1-reward_k1-0.05-0")):
        A.load_runs(params, root)

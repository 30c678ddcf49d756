"""Figures are closed once written: a worker that runs many cells keeps no figure of the ones before."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt

from pipelines.plots import save_run_figure

EVALS = [{"iteration": i, "gold": 0.1 * i, "proxy": 0.2 * i, "kl": 0.5 * i} for i in range(3)]


def test_saving_run_figures_leaves_no_figure_open(tmp_path):
    before = plt.get_fignums()
    for k in range(3):
        save_run_figure(EVALS, f"cell {k}", tmp_path / f"curves{k}.png")
        assert (tmp_path / f"curves{k}.png").stat().st_size > 0
    assert plt.get_fignums() == before


# --- the views of a task (ablations/plots.py write_views, pipelines/analysis.py metrics.json) ---

import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import yaml  # noqa: E402

from tests.helpers import REPO  # noqa: E402


@pytest.fixture(scope="module")
def views(tmp_path_factory):
    """A synthetic grammar grid (tests/ablations/synthetic.py: 12 instances, loss_k3 collapsing past 3 nats), its
    analysis, and the views written from it."""
    from ablations import analysis as A
    from pipelines import analysis as PA
    from tests.ablations import synthetic as syn

    tmp = tmp_path_factory.mktemp("views")
    exp = syn.write_runs(tmp / "runs", behaviours={"loss_k3": syn.Behaviour(crash_above=3.0)})
    tr = A.analyse(syn.protocol(), exp, tmp / "runs", **syn.inputs()).tasks["grammar"]
    written = PA.write_views(tr, syn.inputs()["calibrated"]["grammar"], tmp / "reports" / "grammar")
    return tr, tmp / "reports" / "grammar", written


def test_views_write_metrics_plot_data_and_figures(views):
    _, out, written = views
    names = sorted(p.relative_to(out).as_posix() for p in written)
    assert names == sorted(["metrics.json", *(f"plots/{n}" for n in ("arms.json", "frontier.json", "differences.json")),
                            *(f"figures/{n}" for n in ("arms.png", "frontier.png", "differences.png"))])  # fmt: skip
    assert all(p.stat().st_size > 0 for p in written)


def test_arms_has_every_cell_with_its_median_and_iqr_across_instances(views):
    tr, out, _ = views
    arms = json.loads((out / "plots/arms.json").read_text())
    cells = list(dict.fromkeys(r["cell"] for r in arms))
    assert cells[0] == "no KL" and len(cells) == 1 + len(tr.runs[tr.runs.arm != "none"].groupby(["arm", "level"]))
    assert "loss_k3 β 0.1" in cells and "reward_k1 KL 4.2" in cells and "loss_k3 KL 2.1" in cells
    assert all(r["q25"] <= r["median"] <= r["q75"] and r["n"] == 12 for r in arms)
    # the median at one iteration, by hand: the instances' gold of that cell (one seed each)
    # (its act and tuned cells share β 0.1 here: one cell, each instance the mean of its two runs)
    ev = tr.evals[(tr.evals.arm == "loss_k3") & (tr.evals.kind == "fixed") & (tr.evals.iteration == 60)]
    row = next(r for r in arms if r["cell"] == "loss_k3 β 0.1" and r["iteration"] == 60)
    assert row["median"] == pytest.approx(float(ev.groupby("instance").gold.mean().median()), abs=1e-6)


def test_frontier_draws_each_placement_with_the_no_kl_trajectory(views):
    _, out, _ = views
    rows = json.loads((out / "plots/frontier.json").read_text())
    panels = dict.fromkeys(r["placement"] for r in rows)
    assert set(panels) == {"reward", "loss"}
    for p in panels:
        cells = {r["cell"] for r in rows if r["placement"] == p}
        assert "no KL" in cells and all(c == "no KL" or c.startswith(p) for c in cells)
    assert all({"kl", "gold", "iteration"} <= set(r) for r in rows)


def test_differences_are_each_comparisons_paired_differences_by_instance(views):
    tr, out, _ = views
    rows = json.loads((out / "plots/differences.json").read_text())
    assert list(dict.fromkeys(x["comparison"] for x in rows)) == [r["comparison"] for r in tr.primary]
    for r in tr.primary:  # generic over whatever comparisons the analysis returned (a frontier level each)
        mine = [x for x in rows if x["comparison"] == r["comparison"]]
        assert [x["instance"] for x in mine] == list(range(12))  # the pre-registered order
        assert {x["question"] for x in mine} == {r["question"]} and mine[0]["contrast"] == r["contrast"]
        assert sum(x["decided"] for x in mine) == r["n"]
        decided = [x["difference"] for x in mine if x["decided"]]
        assert np.median(decided) == pytest.approx(r["estimate"], abs=1e-5)  # the estimand: the median


def test_metrics_json_is_flat_identifier_safe_and_generic_over_the_comparisons():
    from pipelines.analysis import headline_metrics

    rows = [
        {"question": "same_beta", "comparison": "same estimator, same β", "verdict": "equivalent",
         "label": "equivalent; a non-zero difference inside the margin", "estimate": 0.01, "lo": -0.02, "hi": 0.04,
         "n": 8, "cap": 24},
        {"question": "frontier", "comparison": "frontier@level 2", "verdict": "inconclusive", "label": "inconclusive",
         "estimate": 0.2, "lo": float("nan"), "hi": None, "n": 4, "cap": 12},
    ]  # fmt: skip
    protocol = {"coef": 0.03, "control_coef": 0.1, "levels": [1.5, 3.0, 6.0], "margins": {"gold": 0.14, "log_kl": 0.2},
                "tuned": {"loss_k3": 0.1}}  # fmt: skip
    m = headline_metrics(rows, "not settled", {"alpha": 0.05}, 24, protocol)
    assert all(re.fullmatch(r"[A-Za-z0-9_]+", k) for k in m), list(m)
    assert m["headline"] == "not settled" and m["same_estimator_same_verdict"] == "equivalent"  # ASCII only
    assert m["same_estimator_same_label"].startswith("equivalent; a non-zero") and m["same_estimator_same_cap"] == 24
    assert m["frontier_level_2_estimate"] == 0.2 and "frontier_level_2_lo" not in m and "frontier_level_2_hi" not in m
    assert (m["frontier_level_2_n"], m["frontier_level_2_cap"]) == (4, 12)
    assert m["beta"] == 0.03 and m["control_beta"] == 0.1 and m["beta_loss_k3"] == 0.1 and m["n_instances"] == 24
    assert m["margin_gold"] == 0.14 and m["margin_log_kl"] == 0.2
    assert (m["kl_level_1"], m["kl_level_2"], m["kl_level_3"]) == (1.5, 3.0, 6.0) and "kl_target" not in m
    assert not any(k.startswith(("Q1", "Q2", "Q3", "Q4")) for k in m)  # v3's question ids are gone
    assert not any(isinstance(v, dict | list) for v in m.values())


def test_dvc_plots_show_draws_three_plots_per_task_from_the_views(views, tmp_path):
    """dvc.yaml's top-level plots with the templates of .dvc/plots/, rendered by DVC itself (`dvc plots show
    --json`): each of a task's three plots gets its data and a vega-lite spec."""
    _, out, _ = views
    import shutil

    env = {"DVC_NO_ANALYTICS": "1", "PATH": f"{sys.executable.rsplit('/', 1)[0]}:/usr/bin:/bin"}
    for cmd in (["git", "init", "-q"], [sys.executable, "-m", "dvc", "init", "-q"]):
        subprocess.run(cmd, cwd=tmp_path, check=True, env=env)
    shutil.copytree(REPO / ".dvc" / "plots", tmp_path / ".dvc" / "plots")
    shutil.copytree(out, tmp_path / "reports" / "grammar")
    plots = [
        p for p in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"] if next(iter(p)).startswith("grammar_")
    ]
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"plots": plots}))
    shown = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "--json"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, check=True).stdout  # fmt: skip
    doc = json.loads(shown)
    assert not doc.get("errors"), doc.get("errors")
    specs = {name: entries[0] for name, entries in doc["data"].items()}
    assert set(specs) == {"grammar_arms", "grammar_frontier", "grammar_differences"}
    for name, entry in specs.items():
        content = entry["content"]
        assert content["$schema"].startswith("https://vega.github.io/schema/vega-lite/v5")
        assert content["title"].startswith("grammar: ") and entry["revisions"] == ["workspace"]
        datapoints = content["data"]["values"]
        view = json.loads((out / "plots" / f"{name.split('_', 1)[1]}.json").read_text())
        assert len(datapoints) == len(view) and all(d["rev"] == "workspace" for d in datapoints)

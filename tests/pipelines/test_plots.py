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

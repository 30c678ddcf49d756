"""Pieces of the questions: family construction and cross-fitted tuning."""

import math

import pandas as pd

from ablations import questions as Q

from . import synthetic as syn


def test_pairs_cross_placements_within_estimators_and_compare_with_the_reference():
    specs = {**syn.CROSSED, "old_loss_k2": syn.spec("loss", "k2", target="old_policy")}
    pairs = Q.comparison_pairs(specs, "reward_k1")
    assert ("loss_k1", "reward_k1", "placement (k1)") in pairs and ("loss_k2", "reward_k2", "placement (k2)") in pairs
    assert ("old_loss_k2", "reward_k1", "vs reference") in pairs
    assert not any(a == "old_loss_k2" and role.startswith("placement") for a, _, role in pairs)  # target differs
    assert len({frozenset(p[:2]) for p in pairs}) == len(pairs) == 5  # loss_k1 vs reward_k1 appears once


def table(values: dict[float, list[float]]) -> pd.DataFrame:
    return pd.DataFrame(values, index=range(len(next(iter(values.values())))))


def test_cross_fit_selects_on_one_fold_and_evaluates_on_the_other():
    # instances 0, 2, 4 (fold A) do best at 0.1; instances 1, 3, 5 (fold B) at 0.3
    t = table({0.1: [1.0, 0.0, 1.0, 0.0, 1.0, 0.0], 0.3: [0.0, 1.0, 0.0, 1.0, 0.0, 1.0]})
    chosen, sels = Q.cross_fit(t, ([0, 2, 4], [1, 3, 5]))
    assert chosen == {1: 0.1, 3: 0.1, 5: 0.1, 0: 0.3, 2: 0.3, 4: 0.3}  # each fold gets the OTHER fold's choice
    assert [(s["selected_on"], s["coef"], s["evaluated_on"]) for s in sels] == [
        ((0, 2, 4), 0.1, (1, 3, 5)),
        ((1, 3, 5), 0.3, (0, 2, 4)),
    ]


def test_an_instance_never_chooses_its_own_coefficient():
    """Making instance i look best at some coefficient never changes the coefficient applied to i."""
    base = table({0.03: [0.1, 0.2, 0.0, 0.1, 0.3, 0.2], 0.1: [0.2, 0.1, 0.1, 0.3, 0.2, 0.1], 0.3: [0.0] * 6})
    folds = ([0, 2, 4], [1, 3, 5])
    before, _ = Q.cross_fit(base, folds)
    for i in range(6):
        for c in base.columns:
            t = base.copy()
            t.loc[i, c] = 100.0
            after, _ = Q.cross_fit(t, folds)
            assert after[i] == before[i]


def test_cross_fit_ties_go_to_the_smaller_coefficient_and_folds_need_instances():
    t = table({0.3: [1.0, 1.0], 0.1: [1.0, 1.0]})
    chosen, _ = Q.cross_fit(t, ([0], [1]))
    assert chosen == {0: 0.1, 1: 0.1}
    assert Q.cross_fit(table({0.1: [1.0]}), ([0], []))[0] == {}


def test_tuned_values_read_the_chosen_cell(tmp_path):
    from ablations.load import load_runs

    runs, _ = load_runs(syn.write_runs(tmp_path, coefs=(0.03, 0.3), targets=()), tmp_path)
    units = Q.unit_table(runs)
    chosen = {i: (0.03 if i % 2 else 0.3) for i in range(6)}
    v = Q.tuned_values(units, "loss_k2", "final_gold", chosen)
    for i, c in chosen.items():
        r = runs[(runs.arm == "loss_k2") & (runs.level == c) & (runs.instance == i)]
        assert math.isclose(v[i], r.final_gold.mean())

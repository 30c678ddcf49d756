"""An arm's spec fields are derived from KLConfig and PPOConfig (ablations.experiment.SPEC_FIELDS), so a new KL or
policy-loss option shows in summary.json when on, in the diagnostics table and in its description, without being
listed anywhere."""

from __future__ import annotations

import typing

import pandas as pd
import pytest

from ablations import diagnostics, tables
from ablations.experiment import SPEC_FIELDS, SPEC_OPTIONS, SUMMARY_ALWAYS, Arm, _spec_field, option_on
from pipelines import ppo


def test_the_spec_fields_are_the_arm_fields():
    assert set(SPEC_FIELDS) == set(Arm.model_fields) and len(SPEC_FIELDS) == len(set(SPEC_FIELDS))
    assert SPEC_FIELDS[:5] == ("algorithm", "group_size", "target", "placement", "estimator")
    assert set(SUMMARY_ALWAYS) <= set(SPEC_FIELDS)
    assert diagnostics.SPEC == SPEC_FIELDS


def a_value(field: str):
    """A value that switches option ``field`` on."""
    info = _spec_field(field)
    args = [a for a in typing.get_args(info.annotation) if a is not type(None)]
    kind = args[0] if args else info.annotation
    if kind is bool:
        return True
    if typing.get_origin(kind) is typing.Literal:
        return next(v for v in typing.get_args(kind) if v != info.default)
    return 0.5


@pytest.mark.parametrize("field", SPEC_OPTIONS)
def test_every_option_is_off_at_its_default_and_on_when_set(field):
    off, on = _default(field), a_value(field)
    assert not option_on(field, off) and option_on(field, on)
    assert ppo._on(off) == option_on(field, off) and ppo._on(on) == option_on(field, on)  # what summary.json writes


def _default(field: str):
    return _spec_field(field).default  # KLConfig's or PPOConfig's (an Arm's PPO fields default to the task's)


@pytest.mark.parametrize("field", SPEC_OPTIONS)
def test_an_option_one_arm_sets_is_a_column_of_the_diagnostics_table(field):
    base = {f: _default(f) if f in SPEC_OPTIONS else "x" for f in SPEC_FIELDS}
    t = pd.DataFrame([{"arm": "a", **base}, {"arm": "b", **base, field: a_value(field)}])
    varying, common = tables.diagnostic_spec(t)
    assert varying == [field]
    assert tables.spec_label(field) and field not in common

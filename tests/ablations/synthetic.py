"""Synthetic run directories in the grid's layout (protocol v4), with planted behaviour, for the analysis tests.

Evaluation runs (``write_runs``): on each evaluation instance the no-KL baseline, every design cell
``<arm>-<role>`` of params.yaml's grid.design (by group, each group on the instances its allocation gives it)
resolved against a calibrated protocol dict (``calibrated``: the keys ablations/calibration.py ``calibrate``
returns, values that fit the planted curves, with a synthetic sample-size plan, ``plan``;
runs/<task>/design/<i>-<arm>-<role>-<s>, summary kind fixed or, for a level role, matched, with its ``role``), and
optionally exploratory fixed/matched cells. Calibration runs (``write_calibration_runs``): the no-KL baseline and
each calibration arm at each calibration coefficient on the calibration instances, for ablations/calibration.py.
Planning runs (``write_plan_runs``): the no-KL baseline and every design entry on the planning instances, for
ablations/plan.py. Arms, design, primary questions, checks, calibration rules and coefficients are params.yaml's
(``_params``), never copied here.

Each run's final exact KL follows from its arm and coefficient (fixed runs), its KL target (matched runs) or nothing
(no KL): K0 / (1 + restraint x 40 x coef), K0 about 18 nats per instance; its gold follows an over-optimisation
curve of KL (Gao et al. 2022: gold = a sqrt(KL) - b KL, peak at 4 nats for grammar; a saturating accuracy curve
for arithmetic), scaled and shifted per instance, plus noise. An arm can be planted to restrain less, to gain or
lose gold, to crash past a KL level (late collapse), or to ignore its KL controller (not steerable); single runs can
be planted to miss their KL target.

Gradient diagnostics (diagnostics.csv, as pipelines/ppo.py writes it): ``diagnostics`` plants per arm and regime
the mean of each metric; every run of such an arm (of the kinds in ``diag_kinds``) gets one row per checkpoint in
``DIAG_AT`` and regime, the planted value plus an instance offset and row noise. Every other run gets the header-only
file of a cell with diagnostics off, or no file at all (``diag_absent``: runs written before the file existed).

``python -m tests.ablations.synthetic OUT`` writes a sample report from a synthetic two-task grid into OUT.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from ablations.experiment import SHARED, split_entry
from ablations.load import BASELINE, ExpectedRun

ITERS = np.arange(0, 65, 5)
DIAG_AT = (20, 40)
DIAG_UPDATES = 7  # off-policy updates of the default ppo section: 4 epochs x 2 minibatches - 1


def planted(cosine, scale, rel_bias, noise, rel_var, cosine_minibatch=None) -> dict[str, float]:
    """A planted diagnostic row's metrics (rel_bias_excess follows from rel_bias and its noise floor)."""
    mb = cosine / 2 if cosine_minibatch is None else cosine_minibatch
    return dict(cosine=cosine, cosine_noise_floor=0.95, cosine_minibatch=mb, scale=scale, rel_bias=rel_bias,
                rel_bias_noise=noise, rel_var=rel_var)  # fmt: skip


# planted diagnostics with the shape of benchmarks/diagnostics.json: k1 in the reward follows the true gradient
# on-policy; k1 in the loss has a mean-zero gradient; off-policy every estimate drifts (values are planted, the tests
# only check that the table reproduces them)
THEORY = {
    "reward_k1": {"on_policy": planted(0.8, 1.0, 0.9, 0.9, 11.0), "off_policy": planted(0.64, 0.71, 0.91, 0.82, 9.8)},
    "loss_k1": {"on_policy": planted(0.14, 0.03, 0.99, 0.43, 0.9), "off_policy": planted(0.05, 0.01, 1.0, 0.4, 0.8)},
    "reward_k3": {"on_policy": planted(0.3, 1.6, 5.7, 4.9, 389.0), "off_policy": planted(0.14, 0.74, 5.3, 5.0, 404)},
    "loss_k3": {"on_policy": planted(0.8, 1.0, 0.9, 0.9, 11.0), "off_policy": planted(0.7, 0.9, 0.8, 0.7, 9.0)},
}


def _diagnostics_csv(plant: dict[str, dict[str, float]], offset: float, rng) -> pd.DataFrame:
    """Rows of one run's diagnostics.csv: every checkpoint x planted regime, value + offset + noise (1% of |value|
    for the positive, unbounded metrics)."""
    rows = []
    for it in DIAG_AT:
        for regime, metrics in plant.items():
            v = {m: x + offset + rng.normal(0, 0.01) if m.startswith("cosine") or m == "scale"
                 else x * (1 + offset + rng.normal(0, 0.01)) for m, x in metrics.items()}  # fmt: skip
            v["rel_bias_excess"] = math.sqrt(max(v["rel_bias"] ** 2 - v["rel_bias_noise"] ** 2, 0.0))
            updates = 0 if regime == "on_policy" else DIAG_UPDATES
            rows.append({"iteration": it, "regime": regime, "updates": updates, "strength": 1.0,
                         "against": "reference", **v, "true_norm": 3.2, "true_rel_se": 0.3})  # fmt: skip
    return pd.DataFrame(rows)


@dataclass(frozen=True)
class Behaviour:
    restraint: float = 1.0  # final KL = K0 / (1 + restraint * 40 * coef)
    gold_offset: float = 0.0  # added to gold once training starts
    crash_above: float | None = None  # gold crashes to SFT + crash_to once KL passes this
    crash_to: float = -2.0
    steerable: bool = True  # False: the controller cannot move it (final KL as at the initial coefficient)
    length_offset: float = 0.0
    instance_offset: dict | tuple = ()  # added to gold once training starts: by instance (dict) or position (tuple)

    def offset(self, instance: int, position: int) -> float:
        o = self.instance_offset
        if isinstance(o, dict):
            return float(o.get(instance, 0.0))
        return float(o[position]) if position < len(o) else 0.0


FLAT = lambda task, kl: {"gold": 0.0 * kl}  # no gain and no over-optimisation: no KL = any KL in gold


def spec(placement: str, estimator: str, target: str = "reference", algorithm: str = "ppo", **options) -> dict:
    return dict(algorithm=algorithm, target=target, placement=placement, estimator=estimator, **options)


def config(sp: dict, coef, kl_target, seed: int) -> dict:
    """The nested PPOConfig pipelines/ppo.py writes into summary.json, for the arm ``sp`` at its strength."""
    from ..conftest import small_ppo_config

    rest = {k: v for k, v in sp.items() if k != "algorithm"}
    kl = dict(placement="none", estimator=None, coef=0.0) if sp["placement"] == "none" else dict(rest, coef=0.1)
    if kl_target is not None:
        kl |= dict(coef=0.1, adaptive_target=float(kl_target), horizon=128)
    elif coef is not None:
        kl["coef"] = float(coef)
    group = {"group_size": 2} if sp["algorithm"] in ("grpo", "rloo") else {}
    return small_ppo_config(kl=kl, algorithm=sp["algorithm"], seed=seed, **group).model_dump(mode="json")


def _params() -> dict:
    """The repository's params.yaml: every protocol, design and calibration value the synthetic grid does not plant
    comes from there, so a new knob, arm, design cell or primary question needs a value in params.yaml only (never a
    copy here)."""
    from ..conftest import repo_params

    return repo_params()


_P = _params()
# params.yaml's arms (every design cell's arm among them); CROSSED: placement x estimator for the two camps'
# estimators, the arms the exploratory families cross
ARMS = {name: spec(**{"algorithm": "ppo", **arm}) for name, arm in _P["grid"]["arms"].items()}
CROSSED = {f"{p}_{e}": ARMS[f"{p}_{e}"] for e in ("k1", "k3") for p in ("reward", "loss")}
REFERENCE = _P["analysis"]["reference_arm"]
CALIBRATION_ARMS = tuple(_P["grid"]["calibration_arms"])
# params.yaml's design, by group (<arm>-<role> entries), and flat; its primary questions and checks
GROUPS = {g: tuple(cells) for g, cells in _P["grid"]["design"].items()}
DESIGN = tuple(e for cells in GROUPS.values() for e in cells)
PRIMARY = _P["analysis"]["primary"]
CHECKS = _P["analysis"]["checks"]
CALIBRATION_COEFS = {t: tuple(_P[t]["calibration"]["coefs"]) for t in ("grammar", "arithmetic")}
# the groups that run on evaluation instances (params.yaml allocates grammar's some; `checks` runs on the planning
# instances only)
EVALUATED = tuple(g for g in GROUPS if g == SHARED or _P["grammar"]["allocation"][g])
CAP = 12  # the synthetic plan's cap of every comparison: 3 looks of 4, only the last reachable at alpha/9

# each task's calibration rules: params.yaml's, on the synthetic calibration instances and coefficients
RULES = {
    task: {**_P[task]["calibration"], "instances": [0, 1, 2], "coefs": list(coefs)}
    for task, coefs in CALIBRATION_COEFS.items()
}


def comparison_names(n_levels: int = 3, questions: dict | None = None) -> list[str]:
    """The primary comparisons of ``questions`` (default params.yaml's), a levels question once per level."""
    from ablations.comparisons import comparisons
    from ablations.protocol_params import Primary

    qs = {q: Primary(**v) for q, v in (PRIMARY if questions is None else questions).items()}
    return [c.name for c in comparisons(qs, n_levels)]


def plan(task: str = "grammar", cap: int | dict = CAP, questions: dict | None = None, n_levels: int = 3) -> dict:
    """A protocol/<task>.plan.json as pipelines/plan.py writes it (ablations/plan.py): every comparison's cap
    (``cap``: one for all, or by comparison name, default CAP) and planning noise (values for the report only)."""
    names = comparison_names(n_levels, questions)
    caps = {c: (cap.get(c, CAP) if isinstance(cap, dict) else cap) for c in names}
    s = _P["analysis"]["sequential"]
    comp = {c: dict(cap=k, reached=True, power_pos=0.9, power_neg=0.9, power_equivalent=0.5, margin=0.03, level=None,
                    n_plan=8, median=0.0, sd=0.03, sd_margins=1.0, skewness=0.0, hit_rate_arm=None,
                    hit_rate_other=None) for c, k in caps.items()}  # fmt: skip
    rule = dict(test="sign test of the median", alpha=_P["analysis"]["alpha"], comparisons=len(names),
                alpha_per_comparison=_P["analysis"]["alpha"] / len(names), batch_size=4, max_cap=max(caps.values()),
                power=s["power"], effect_margins=s["effect"], simulations=s["simulations"])  # fmt: skip
    checks = {c: dict(n=8, median=1.2, lo=0.9, hi=1.6, level=0.95, p_sign=0.0078, margin=0.4, ci="beyond the margin")
              for c in _P["analysis"]["checks"]}  # fmt: skip
    return {"task": task, "plan_instances": list(_P[task]["calibration"]["plan_instances"]), "rule": rule,
            "comparisons": comp, "checks": checks}  # fmt: skip


def calibrated(task: str = "grammar", plan_: dict | None = None, **overrides) -> dict:
    """A calibrated protocol dict with every key ablations.calibration.calibrate returns (plus the ``frozen``, ``plan``
    and ``plan_frozen`` records pipelines/analysis.py adds), its values those of the planted curves on calibration
    instances 0-2 (checked against calibrate() on write_calibration_runs in test_calibration.py); ``plan_``: the
    plan (default ``plan(task)``: every comparison capped at CAP).

    Grammar: peak gain 0.12 -> gold margin 0.03; the penalty acts (no-KL contrast >= 2 margins) at every
    calibration coefficient and gold is best at 0.1 (final KL 3.6, at the gold peak): coef 0.1; the control is
    interpolated on the weaker side (0.023, KL about 9) and costs one margin of gold, raising log KL by about 0.93
    (the log-KL margin 0.4: 1/4 of no KL's ln 18 - ln 3.6); no KL ends past the peak (below the reference arm in
    gold, above it in log KL); levels 1/8, 1/4, 1/2 of no KL's median final KL (16.8 nats on instances 0-2).
    Arithmetic: gold rises with KL, so the weakest coefficient (0.03) is each arm's best but the penalty acts there
    by less than 2 margins: the questions ask at 0.3 (the best acting coefficient), the control is 0.12 (more KL,
    more gold), no KL ends above the reference arm; log-KL margin 1/4 of ln 13."""
    if task == "grammar":
        out = dict(margins={"gold": 0.03, "log_kl": 0.4}, levels=[2.1, 4.2, 8.4], coef=0.1, acts_on_calibration=True,
                   no_kl_contrast={"0.01": -0.07, "0.03": -0.12, "0.1": -0.14, "0.3": -0.11},
                   tuned={"reward_k1": 0.1, "loss_k3": 0.1}, control_coef=0.023, control_interpolated=True,
                   control_effect={"gold": 0.03, "log_kl": -0.93}, control_direction={"gold": 1, "log_kl": -1},
                   no_kl_direction={"gold": -1, "log_kl": 1},
                   no_kl=dict(sft_gold=0.0, peak_gold=0.12, final_gold=-0.03, final_log_kl=2.9, peak_kl=[4.5] * 3,
                              final_kl=[18.0] * 3, peak_iteration=[20] * 3, gain=0.12))  # fmt: skip
    else:
        out = dict(margins={"gold": 0.1, "ood_gold": 0.1, "log_kl": 0.64}, levels=[2.1, 4.2, 8.4], coef=0.3,
                   acts_on_calibration=True, no_kl_contrast={"0.03": 0.06, "0.1": 0.18, "0.3": 0.3, "1": 0.37},
                   tuned={"reward_k1": 0.03, "loss_k3": 0.03}, control_coef=0.12, control_interpolated=True,
                   control_effect={"gold": -0.1, "log_kl": -0.81}, control_direction={"gold": -1, "log_kl": -1},
                   no_kl_direction={"gold": 1, "log_kl": 1},
                   no_kl=dict(sft_gold=0.3, peak_gold=0.7, final_gold=0.7, final_log_kl=2.9, peak_kl=[18.0] * 3,
                              final_kl=[18.0] * 3, peak_iteration=[60] * 3, gain=0.4))  # fmt: skip
    coefs = CALIBRATION_COEFS[task]
    rec = lambda path: {"path": path, "sha256": "0" * 64, "commit": None}
    out = {
        "task": task,
        "calibration_instances": [0, 1, 2],
        "rules": RULES[task],
        **out,
        "calibration_gold": {a: {f"{c:g}": 0.0 for c in coefs} for a in CALIBRATION_ARMS},
        "calibration_log_kl": {a: {f"{c:g}": 0.0 for c in coefs} for a in CALIBRATION_ARMS},
        "frozen": rec(f"protocol/{task}.json"),
        "plan": plan(task) if plan_ is None else plan_,
        "plan_frozen": rec(f"protocol/{task}.plan.json"),
    }
    out.update(overrides)
    return out


def role_cell(cal: dict, arm: str, role: str, initial_coef: float) -> tuple[str, float, float | None]:
    """(kind, coef, kl_target) of a design cell resolved against ``cal`` (as ablations/grid.py resolve does)."""
    from ablations.experiment import role_kind
    from ablations.grid import role_value

    value = role_value(cal, arm, role)
    return ("matched", initial_coef, value) if role_kind(role) == "level" else ("fixed", value, None)


def _curves(task: str, kl: np.ndarray) -> dict[str, np.ndarray]:
    """Gold-like metrics as functions of KL (gains over the SFT policy)."""
    if task == "arithmetic":
        return {"gold": 0.4 * (1 - np.exp(-kl / 4)), "ood_gold": 0.15 * (1 - np.exp(-kl / 4)) - 0.004 * kl}
    return {"gold": 0.12 * np.sqrt(kl) - 0.03 * kl}


def _write(root: Path, rel: Path, summary: dict, ev: pd.DataFrame, diag: pd.DataFrame | None) -> None:
    """A run directory; ``diag`` None: no diagnostics.csv, empty: the header-only file of diagnostics off."""
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    ev.to_csv(d / "evals.csv", index=False)
    if diag is not None:
        (d / "diagnostics.csv").write_text(diag.to_csv(index=False) if len(diag) else "iteration,regime\n")
    pd.DataFrame({"iteration": ev.iteration, "kl_coef": summary["coef"]}).to_csv(d / "history.csv", index=False)
    (d / "summary.json").write_text(json.dumps(summary))


@dataclass(frozen=True)
class _Cell:
    arm: str
    kind: str  # the summary's kind: baseline, fixed, matched, calibration_baseline, calibration
    folder: str  # runs/<task>/<folder>/
    coef: float
    kl_target: float | None = None
    role: str | None = None
    group: str | None = None  # a design or plan cell's grid.design group
    instances: tuple | None = None  # the instances it runs on (None: every one written)

    @property
    def stage_group(self) -> str:
        """The dvc.yaml stage group (as ablations/grid.py Cell.group names it)."""
        return self.folder if self.group in (None, SHARED) else f"{self.folder}_{self.group}"

    def name(self, i: int, s: int) -> str:
        if self.arm == BASELINE:
            return f"{i}-{s}"
        if self.role:
            return f"{i}-{self.arm}-{self.role}-{s}"
        return f"{i}-{self.arm}-{(self.kl_target if self.kind == 'matched' else self.coef):g}-{s}"


def _write_cells(root, task, cells, arms, behaviours, instances, seeds, *, misses=(), noise, rng, curves,
                 diagnostics=None, diag_kinds=(), diag_absent=False, drng=None) -> list[ExpectedRun]:  # fmt: skip
    """Writes every run of ``cells`` x instances x seeds; returns the expected runs."""
    diagnostics = diagnostics or {}
    drng = drng if drng is not None else np.random.default_rng(0)
    doff = {i: drng.normal(0, 0.02) for i in instances}
    inst = {i: (rng.normal(0, 0.02), 1 + rng.normal(0, 0.1), 18 * (1 + rng.normal(0, 0.1))) for i in instances}
    out = []
    for c in cells:
        b = behaviours.get(c.arm, Behaviour())
        for pos, i in enumerate(instances):
            if c.instances is not None and i not in c.instances:
                continue
            sft, gain, k0 = inst[i]
            for s in seeds:
                final_kl = k0 / (1 + (0 if c.arm == BASELINE else b.restraint) * 40 * c.coef)
                if c.kind == "matched" and b.steerable:
                    final_kl = c.kl_target * (1 + rng.normal(0, 0.03))
                    final_kl *= 1.6 if (c.arm, c.kl_target, i, s) in misses else 1.0
                kl = final_kl * (ITERS / ITERS[-1]) ** 1.2 * (1 + rng.normal(0, 0.01, len(ITERS)))
                kl[0] = 0.0
                started = ITERS > 0
                ev = {"iteration": ITERS, "kl": kl}
                bases = {"gold": sft} if task == "grammar" else {"gold": 0.3 + sft, "ood_gold": 0.25 + sft}
                for m, g in (curves or _curves)(task, kl).items():
                    base = bases[m]
                    off = b.gold_offset + b.offset(i, pos)
                    v = base + gain * g + off * started
                    if b.crash_above is not None:
                        v = np.where(kl > b.crash_above, base + b.crash_to, v)
                    ev[m] = v + rng.normal(0, noise, len(ITERS)) * started
                ev["length"] = 8 + b.length_offset * started + 0.1 * kl + rng.normal(0, 0.1, len(ITERS))
                ev["empty"] = np.clip(0.01 + 0.002 * kl, 0, 1)
                ev["entropy"] = 1.0 - 0.01 * kl
                if task == "grammar":
                    ev["proxy"] = ev["gold"] + 0.05 * kl
                    ev["illegal"] = np.clip(0.01 * kl, 0, 1)
                ev = pd.DataFrame(ev)
                name = c.name(i, s)
                rel = Path("runs") / task / c.folder / name
                sp = spec("none", "none") if c.arm == BASELINE else arms[c.arm]
                summary = dict(
                    stage=f"{task}_{c.stage_group}@{name}", task=task, kind=c.kind, role=c.role, instance=i, seed=s,
                    arm=c.arm, coef=c.coef, kl_target=c.kl_target, **sp, config=config(sp, c.coef, c.kl_target, s),
                    **{f"final_{m}": float(ev[m].iloc[-1]) for m in ev.columns if m != "iteration"},
                    **{f"sft_{m}": float(ev[m].iloc[0]) for m in ev.columns if m != "iteration"},
                    peak_gold=float(ev.gold.max()), peak_gold_iteration=int(ev.iteration[ev.gold.idxmax()]),
                )  # fmt: skip
                if c.arm in diagnostics and c.kind in diag_kinds:
                    diag = _diagnostics_csv(diagnostics[c.arm], doff[i], drng)
                else:
                    diag = None if diag_absent else pd.DataFrame()
                _write(root, rel, summary, ev, diag)
                out.append(ExpectedRun(summary["stage"], rel))
    return out


def _design(design) -> list[tuple[str, str, str]]:
    """(group, arm, role) of ``design``: a mapping group -> entries, or entries (each in the group params.yaml gives
    it; the shared group if none)."""
    if isinstance(design, dict):
        return [(g, *split_entry(e)) for g, cells in design.items() for e in cells]
    group = {e: g for g, cells in GROUPS.items() for e in cells}
    return [(group.get(e, SHARED), *split_entry(e)) for e in design]


def write_runs(
    root: Path,
    *,
    task: str = "grammar",
    arms: dict[str, dict] | None = None,
    behaviours: dict[str, Behaviour] | None = None,
    instances=range(12),
    seeds=(0,),
    design=None,
    allocation: dict[str, list[int]] | None = None,
    protocol: dict | None = None,
    coefs=(),
    targets=(),
    initial_coef: float = 0.1,
    misses=(),
    noise: float = 0.005,
    rng_seed: int = 0,
    curves=None,
    diagnostics: dict[str, dict[str, dict[str, float]]] | None = None,
    diag_kinds=("fixed", "matched"),
    diag_absent: bool = False,
) -> list[ExpectedRun]:
    """Writes every evaluation run of a synthetic grid under ``root``: the no-KL baseline, the ``design`` cells
    (default: every group params.yaml allocates evaluation instances to, EVALUATED) resolved against ``protocol``
    (default ``calibrated(task)``), each group on the instances ``allocation`` gives it (default: every one), and the
    exploratory cells (every arm at ``coefs`` and ``targets``); returns the expected runs. ``misses``: (arm, target,
    instance, seed) matched runs that end 60% above their target; ``curves(task, kl)`` replaces the gold-vs-KL
    curves; ``diagnostics``, ``diag_kinds``, ``diag_absent``: the gradient diagnostics (module docstring)."""
    arms = ARMS if arms is None else arms
    cal = calibrated(task) if protocol is None else protocol
    allocation = allocation or {}
    cells = [_Cell(BASELINE, "baseline", "baseline", 0.0)]
    for group, arm, role in _design({g: GROUPS[g] for g in EVALUATED} if design is None else design):
        kind, coef, target = role_cell(cal, arm, role, initial_coef)
        only = None if group == SHARED or group not in allocation else tuple(allocation[group])
        cells.append(_Cell(arm, kind, "design", coef, target, role, group, only))
    cells += [_Cell(a, "fixed", "fixed", c) for a in arms for c in coefs]
    cells += [_Cell(a, "matched", "matched", initial_coef, t) for a in arms for t in targets]
    return _write_cells(
        root, task, cells, arms, behaviours or {}, list(instances), seeds, misses=misses, noise=noise,
        rng=np.random.default_rng(rng_seed), curves=curves, diagnostics=diagnostics, diag_kinds=diag_kinds,
        diag_absent=diag_absent, drng=np.random.default_rng(rng_seed + 1),
    )  # fmt: skip


def write_plan_runs(
    root: Path,
    *,
    task: str = "grammar",
    behaviours: dict[str, Behaviour] | None = None,
    instances=None,
    seeds=(0,),
    protocol: dict | None = None,
    noise: float = 0.005,
    rng_seed: int = 3,
    curves=None,
) -> list[ExpectedRun]:
    """Writes the planning runs (kinds plan_baseline, and fixed or matched with a role, under runs/<task>/plan/) of
    the planning ``instances`` (default params.yaml's plan_instances): the no-KL baseline and every design entry of
    every group, resolved against ``protocol`` (default ``calibrated(task)``), as ablations/grid.py plan_cells."""
    cal = calibrated(task) if protocol is None else protocol
    instances = _P[task]["calibration"]["plan_instances"] if instances is None else instances
    cells = [_Cell(BASELINE, "plan_baseline", "plan_baseline", 0.0)]
    for group, arm, role in _design(GROUPS):
        kind, coef, target = role_cell(cal, arm, role, _P["grid"]["matched"]["init_coef"])
        cells.append(_Cell(arm, kind, "plan", coef, target, role, group))
    return _write_cells(root, task, cells, ARMS, behaviours or {}, list(instances), seeds, noise=noise,
                        rng=np.random.default_rng(rng_seed), curves=curves)  # fmt: skip


def write_calibration_runs(
    root: Path,
    *,
    task: str = "grammar",
    arms=CALIBRATION_ARMS,
    behaviours: dict[str, Behaviour] | None = None,
    instances=(0, 1, 2),
    seeds=(0,),
    coefs=None,
    noise: float = 0.005,
    rng_seed: int = 7,
    curves=None,
) -> list[ExpectedRun]:
    """Writes the calibration runs (kinds calibration_baseline and calibration) of the calibration ``instances``:
    the no-KL baseline and every calibration arm at every coefficient (default: CALIBRATION_COEFS[task])."""
    coefs = CALIBRATION_COEFS[task] if coefs is None else coefs
    cells = [_Cell(BASELINE, "calibration_baseline", "calibration_baseline", 0.0)]
    cells += [_Cell(a, "calibration", "calibration", c) for a in arms for c in coefs]
    return _write_cells(root, task, cells, ARMS, behaviours or {}, list(instances), seeds, noise=noise,
                        rng=np.random.default_rng(rng_seed), curves=curves)  # fmt: skip


def protocol(tasks=("grammar",), **overrides):
    """An AnalysisParams for the synthetic grid: params.yaml's analysis section (every knob, its primary questions and
    checks), batches of 4 up to a max cap of CAP (each comparison's own cap is the plan's: ``plan``), the tasks
    ``tasks`` and ``overrides``."""
    from ablations.config import AnalysisParams

    analysis = _params()["analysis"]
    raw = {**analysis, "reference_arm": REFERENCE, "primary": PRIMARY, "checks": CHECKS}
    raw["sequential"] = {**analysis["sequential"], "batch_size": 4, "max_cap": CAP}
    raw.update(overrides)
    raw["tasks"] = {t: analysis["tasks"][t] for t in tasks}
    return AnalysisParams(**raw)


def inputs(task: str = "grammar", instances=range(12), cal: dict | None = None) -> dict:
    """The ``calibrated`` and ``order`` arguments of ablations.analysis.analyse/run for one task."""
    return dict(calibrated={task: calibrated(task) if cal is None else cal}, order={task: list(instances)})


def sample(out: Path) -> list[Path]:
    """A sample report: grammar with a planted late collapse of loss_k3 past 3 nats, a non-restraining loss_k1 and
    the gradient diagnostics of THEORY, arithmetic with no planted difference and no diagnostics; 12 instances x 1
    seed, exploratory cells at two coefficients and two targets."""
    from ablations import analysis

    root = out / "synthetic"
    beh = {
        "loss_k3": Behaviour(crash_above=3.0, length_offset=1.5),
        "loss_k1": Behaviour(restraint=0.2),
    }
    written = []
    for task, kw in (("grammar", dict(behaviours=beh, diagnostics=THEORY)), ("arithmetic", dict(rng_seed=1))):
        expected = write_runs(root, task=task, coefs=(0.03, 0.3), targets=(2.0, 8.0), **kw)
        written += analysis.run(protocol((task,)), expected, out / "reports" / task, root, task=task, **inputs(task))
    return written


if __name__ == "__main__":
    for p in sample(Path(sys.argv[1] if len(sys.argv) > 1 else "tmp/sample")):
        print(p)

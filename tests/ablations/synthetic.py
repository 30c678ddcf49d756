"""Synthetic run directories in the grid's layout (protocol v3), with planted behaviour, for the analysis tests.

Evaluation runs (``write_runs``): on each evaluation instance the no-KL baseline, every design cell
``<arm>-<role>`` resolved against a calibrated protocol dict (``calibrated``: the keys ablations/calibration.py
``calibrate`` returns, values that fit the planted curves; runs/<task>/design/<i>-<arm>-<role>-<s>, summary kind
fixed or matched with its ``role``), and optionally exploratory fixed/matched cells. Calibration runs
(``write_calibration_runs``): the no-KL baseline and each calibration arm at each calibration coefficient on the
calibration instances, for ablations/calibration.py.

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


def spec(placement: str, estimator: str, target: str = "reference", algorithm: str = "ppo") -> dict:
    return dict(algorithm=algorithm, target=target, placement=placement, estimator=estimator)


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


# the arms of params.yaml: placement x estimator for the two camps' estimators
CROSSED = {f"{p}_{e}": spec(p, e) for e in ("k1", "k3") for p in ("reward", "loss")}
REFERENCE = "reward_k1"
CALIBRATION_ARMS = ("reward_k1", "loss_k3")
# params.yaml's design: every arm at the reference arm's best coefficient, the margin-sized control, loss_k3 at its
# own best coefficient, and the k3 arms steered to the calibrated KL target
DESIGN = ("reward_k1-coef", "loss_k1-coef", "reward_k3-coef", "loss_k3-coef", "reward_k1-control", "loss_k3-tuned",
          "reward_k3-target", "loss_k3-target")  # fmt: skip
PRIMARY = {
    "Q1": dict(arm="loss_k1", other="reward_k1", role="coef", metric="log_kl"),
    "Q2": dict(arm="loss_k3", other="reward_k3", role="coef", metric="gold"),
    "Q3": dict(arm="loss_k3", other="reward_k3", role="target", metric="gold"),
    "Q4": dict(arm="loss_k3", other="reward_k1", role="tuned", metric="gold"),
}
CALIBRATION_COEFS = {"grammar": (0.01, 0.03, 0.1, 0.3), "arithmetic": (0.03, 0.1, 0.3, 1.0)}


def _params() -> dict:
    """The repository's params.yaml: every protocol and calibration value the synthetic grid does not plant comes
    from there, so a new knob needs a value in params.yaml only (never a copy here)."""
    from ..conftest import repo_params

    return repo_params()


# each task's calibration rules: params.yaml's, on the synthetic calibration instances and coefficients
RULES = {
    task: {**_params()[task]["calibration"], "instances": [0, 1, 2], "coefs": list(coefs)}
    for task, coefs in CALIBRATION_COEFS.items()
}


def calibrated(task: str = "grammar", **overrides) -> dict:
    """A calibrated protocol dict with every key ablations.calibration.calibrate returns (plus the ``frozen`` record
    pipelines/analysis.py adds), its values those of the planted curves on calibration instances 0-2 (checked
    against calibrate() on write_calibration_runs in test_calibration.py). Grammar: peak gain 0.12 -> margin 0.03;
    the reference arm is best at 0.1 (final KL 3.6, at the gold peak); the control 0.3 (KL 1.4) costs it 0.02 gold
    and lowers its log KL by 0.96 (0.03, KL 8.2, costing 0.022, is nearly as close to one margin); no KL ends past
    the peak (below the reference arm). Arithmetic: gold rises with
    KL, so the smallest coefficient is best, the control is 0.1 and no KL ends above the reference arm."""
    if task == "grammar":
        out = dict(margins={"gold": 0.03}, kl_target=4.0, coef=0.1, tuned={"reward_k1": 0.1, "loss_k3": 0.1},
                   control_coef=0.3, control_effect={"gold": 0.02, "log_kl": 0.96},
                   control_direction={"gold": 1, "log_kl": 1}, no_kl_direction={"gold": -1, "log_kl": 1},
                   no_kl=dict(sft_gold=0.0, peak_gold=0.12, final_gold=-0.03, peak_kl=[4.5] * 3, final_kl=[18.0] * 3,
                              peak_iteration=[20] * 3, gain=0.12))  # fmt: skip
    else:
        out = dict(margins={"gold": 0.1, "ood_gold": 0.1}, kl_target=9.0, coef=0.03,
                   tuned={"reward_k1": 0.03, "loss_k3": 0.03}, control_coef=0.1,
                   control_effect={"gold": 0.11, "log_kl": 0.82}, control_direction={"gold": 1, "log_kl": 1},
                   no_kl_direction={"gold": 1, "log_kl": 1},
                   no_kl=dict(sft_gold=0.3, peak_gold=0.7, final_gold=0.7, peak_kl=[18.0] * 3, final_kl=[18.0] * 3,
                              peak_iteration=[60] * 3, gain=0.4))  # fmt: skip
    coefs = CALIBRATION_COEFS[task]
    out = {
        "task": task,
        "calibration_instances": [0, 1, 2],
        "rules": RULES[task],
        **out,
        "calibration_gold": {a: {f"{c:g}": 0.0 for c in coefs} for a in CALIBRATION_ARMS},
        "calibration_log_kl": {a: {f"{c:g}": 0.0 for c in coefs} for a in CALIBRATION_ARMS},
        "frozen": {"path": f"protocol/{task}.json", "sha256": "0" * 64, "commit": None},
    }
    out.update(overrides)
    return out


def role_cell(cal: dict, arm: str, role: str, initial_coef: float) -> tuple[str, float, float | None]:
    """(kind, coef, kl_target) of a design cell resolved against ``cal`` (as ablations/grid.py resolve does)."""
    from ablations.grid import role_value

    value = role_value(cal, arm, role)
    return ("matched", initial_coef, value) if role == "target" else ("fixed", value, None)


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
                    stage=f"{task}_{c.folder}@{name}", task=task, kind=c.kind, role=c.role, instance=i, seed=s,
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


def write_runs(
    root: Path,
    *,
    task: str = "grammar",
    arms: dict[str, dict] | None = None,
    behaviours: dict[str, Behaviour] | None = None,
    instances=range(12),
    seeds=(0,),
    design=DESIGN,
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
    resolved against ``protocol`` (default ``calibrated(task)``) and the exploratory cells (every arm at ``coefs``
    and ``targets``); returns the expected runs. ``misses``: (arm, target, instance, seed) matched runs that end
    60% above their target; ``curves(task, kl)`` replaces the gold-vs-KL curves; ``diagnostics``, ``diag_kinds``,
    ``diag_absent``: the gradient diagnostics (module docstring)."""
    arms = CROSSED if arms is None else arms
    cal = calibrated(task) if protocol is None else protocol
    cells = [_Cell(BASELINE, "baseline", "baseline", 0.0)]
    for entry in design:
        arm, _, role = entry.rpartition("-")
        kind, coef, target = role_cell(cal, arm, role, initial_coef)
        cells.append(_Cell(arm, kind, "design", coef, target, role))
    cells += [_Cell(a, "fixed", "fixed", c) for a in arms for c in coefs]
    cells += [_Cell(a, "matched", "matched", initial_coef, t) for a in arms for t in targets]
    return _write_cells(
        root, task, cells, arms, behaviours or {}, list(instances), seeds, misses=misses, noise=noise,
        rng=np.random.default_rng(rng_seed), curves=curves, diagnostics=diagnostics, diag_kinds=diag_kinds,
        diag_absent=diag_absent, drng=np.random.default_rng(rng_seed + 1),
    )  # fmt: skip


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
    return _write_cells(root, task, cells, CROSSED, behaviours or {}, list(instances), seeds, noise=noise,
                        rng=np.random.default_rng(rng_seed), curves=curves)  # fmt: skip


def protocol(tasks=("grammar",), **overrides):
    """An AnalysisParams for the synthetic grid: params.yaml's analysis section (every knob), but a cap of 12
    instances (3 looks of 4, the first two unreachable by the exact test at alpha/4/3, the third reachable), the
    synthetic arms and questions and ``overrides``."""
    from ablations.config import AnalysisParams

    analysis = _params()["analysis"]
    raw = {**analysis, "reference_arm": REFERENCE, "primary": PRIMARY}
    raw["sequential"] = {**analysis["sequential"], "batch_size": 4, "cap": 12}
    raw.update(overrides)
    raw["tasks"] = {t: {**analysis["tasks"][t], "min_log_kl_reduction": math.log(2)} for t in tasks}  # exactly ln 2
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

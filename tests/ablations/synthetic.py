"""Synthetic run directories in the grid's layout, with planted behaviour, for the analysis tests.

Each run's final exact KL follows from its arm and coefficient (fixed runs), its KL target (matched runs) or nothing
(no KL); its gold follows an over-optimisation curve of KL (Gao et al. 2022: gold = a sqrt(KL) - b KL, peak at
4 nats for grammar; a saturating accuracy curve for arithmetic), shifted per instance, plus noise. An arm can be
planted to restrain less, to gain or lose gold, to crash past a KL level (late collapse), or to ignore its KL
controller (not steerable); single runs can be planted to miss their KL target.

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


# what the theory says (magnitudes as in benchmarks/diagnostics.json): k1 in the reward and k2 in the loss follow the
# true gradient on-policy; k1 in the loss has a mean-zero gradient; off-policy every estimate drifts
THEORY = {
    "reward_k1": {"on_policy": planted(0.8, 1.0, 0.9, 0.9, 11.0), "off_policy": planted(0.64, 0.71, 0.91, 0.82, 9.8)},
    "loss_k1": {"on_policy": planted(0.14, 0.03, 0.99, 0.43, 0.9), "off_policy": planted(0.05, 0.01, 1.0, 0.4, 0.8)},
    "reward_k2": {"on_policy": planted(0.3, 1.6, 5.7, 4.9, 389.0), "off_policy": planted(0.14, 0.74, 5.3, 5.0, 404)},
    "loss_k2": {"on_policy": planted(0.8, 1.0, 0.9, 0.9, 11.0), "off_policy": planted(0.7, 0.9, 0.8, 0.7, 9.0)},
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
    instance_offset: tuple[float, ...] = ()  # added to gold once training starts, by instance


FLAT = lambda task, kl: {"gold": 0.0 * kl}  # no gain and no over-optimisation: no KL = any KL in gold


def spec(placement: str, estimator: str, target: str = "reference", algorithm: str = "ppo") -> dict:
    return dict(algorithm=algorithm, target=target, placement=placement, estimator=estimator)


CROSSED = {f"{p}_{e}": spec(p, e) for e in ("k1", "k2") for p in ("reward", "loss")}


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


def write_runs(
    root: Path,
    *,
    task: str = "grammar",
    arms: dict[str, dict] | None = None,
    behaviours: dict[str, Behaviour] | None = None,
    instances=range(6),
    seeds=(0,),
    coefs=(0.03, 0.1, 0.3),
    targets=(2.0, 8.0),
    initial_coef: float = 0.1,
    misses=(),
    noise: float = 0.005,
    rng_seed: int = 0,
    curves=None,
    diagnostics: dict[str, dict[str, dict[str, float]]] | None = None,
    diag_kinds=("fixed", "matched"),
    diag_absent: bool = False,
) -> list[ExpectedRun]:
    """Writes every run of a synthetic grid under ``root``; returns the expected runs. ``misses``: (arm, target,
    instance, seed) runs that end 60% above their target; ``curves(task, kl)`` replaces the gold-vs-KL curves;
    ``diagnostics``, ``diag_kinds``, ``diag_absent``: the gradient diagnostics (module docstring)."""
    arms = CROSSED if arms is None else arms
    behaviours = behaviours or {}
    diagnostics = diagnostics or {}
    rng = np.random.default_rng(rng_seed)
    drng = np.random.default_rng(rng_seed + 1)  # its own stream: planting diagnostics changes no other value
    doff = {i: drng.normal(0, 0.02) for i in instances}
    out = []
    inst = {i: (rng.normal(0, 0.02), 1 + rng.normal(0, 0.1), 18 * (1 + rng.normal(0, 0.1))) for i in instances}
    cells = [(BASELINE, "baseline", None)]
    cells += [(a, "fixed", c) for a in arms for c in coefs] + [(a, "matched", t) for a in arms for t in targets]
    for arm, kind, lvl in cells:
        b = behaviours.get(arm, Behaviour())
        for i in instances:
            sft, gain, k0 = inst[i]
            for s in seeds:
                coef = {"baseline": 0.0, "fixed": lvl, "matched": initial_coef}[kind]
                final_kl = k0 / (1 + (0 if arm == BASELINE else b.restraint) * 40 * coef)
                if kind == "matched" and b.steerable:
                    final_kl = lvl * (1 + rng.normal(0, 0.03)) * (1.6 if (arm, lvl, i, s) in misses else 1.0)
                kl = final_kl * (ITERS / ITERS[-1]) ** 1.2 * (1 + rng.normal(0, 0.01, len(ITERS)))
                kl[0] = 0.0
                started = ITERS > 0
                ev = {"iteration": ITERS, "kl": kl}
                bases = {"gold": sft} if task == "grammar" else {"gold": 0.3 + sft, "ood_gold": 0.25 + sft}
                for m, g in (curves or _curves)(task, kl).items():
                    base = bases[m]
                    off = b.gold_offset + (b.instance_offset[i] if i < len(b.instance_offset) else 0.0)
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
                name = f"{i}-{s}" if kind == "baseline" else f"{i}-{arm}-{lvl:g}-{s}"
                rel = Path("runs") / task / kind / name
                sp = spec("none", "none") if arm == BASELINE else arms[arm]
                summary = dict(
                    stage=f"{kind}@{task}-{name}", task=task, kind=kind, instance=i, seed=s, arm=arm, coef=coef,
                    kl_target=lvl if kind == "matched" else None, **sp,
                    **{f"final_{m}": float(ev[m].iloc[-1]) for m in ev.columns if m != "iteration"},
                    **{f"sft_{m}": float(ev[m].iloc[0]) for m in ev.columns if m != "iteration"},
                    peak_gold=float(ev.gold.max()), peak_gold_iteration=int(ev.iteration[ev.gold.idxmax()]),
                )  # fmt: skip
                if arm in diagnostics and kind in diag_kinds:
                    diag = _diagnostics_csv(diagnostics[arm], doff[i], drng)
                else:
                    diag = None if diag_absent else pd.DataFrame()
                _write(root, rel, summary, ev, diag)
                out.append(ExpectedRun(summary["stage"], rel))
    return out


def protocol(tasks=("grammar",), **overrides):
    """An AnalysisParams for the synthetic grid (values as in params.yaml unless overridden)."""
    from ablations.config import AnalysisParams

    per_task = {
        "grammar": dict(margins={"gold": 0.03}, min_log_kl_reduction=math.log(2), kl_tolerance=0.25,
                        collapse_drop=0.03),
        "arithmetic": dict(margins={"gold": 0.03, "ood_gold": 0.03}, min_log_kl_reduction=math.log(2),
                           kl_tolerance=0.25, collapse_drop=0.03),
    }  # fmt: skip
    raw = dict(reference_arm="reward_k1", alpha=0.05, power=0.8, min_hit_rate=0.8, bimodality_alpha=0.01)
    raw.update(overrides)
    raw["tasks"] = {t: per_task[t] for t in tasks}
    return AnalysisParams(**raw)


def sample(out: Path) -> list[Path]:
    """A sample report: grammar with a planted late collapse of loss_k1, a non-restraining old-policy arm and the
    gradient diagnostics of THEORY, arithmetic with no planted difference and no diagnostics; 6 instances x 1 seed."""
    from ablations import analysis

    root = out / "synthetic"
    arms = {**CROSSED, "old_loss_k2": spec("loss", "k2", target="old_policy")}
    beh = {
        "loss_k1": Behaviour(restraint=0.05, crash_above=12.0, steerable=False, length_offset=1.5),
        "old_loss_k2": Behaviour(restraint=0.2),
        "loss_k2": Behaviour(length_offset=0.8),
    }
    expected = write_runs(
        root, task="grammar", arms=arms, behaviours=beh, misses={("reward_k2", 8.0, 3, 0)}, diagnostics=THEORY
    )
    expected += write_runs(root, task="arithmetic", arms=CROSSED, rng_seed=1, targets=(2.0, 6.0))
    from ablations.lock import protocol_lock

    lock = protocol_lock(".", ("analysis", "grid.coefs", "grid.kl_targets"), {r.stage for r in expected})
    return analysis.run(protocol(("grammar", "arithmetic")), expected, out / "reports", root, lock)


if __name__ == "__main__":
    for p in sample(Path(sys.argv[1] if len(sys.argv) > 1 else "tmp/sample")):
        print(p)

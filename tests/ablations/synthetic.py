"""Synthetic run directories in the grid's layout, with planted behaviour, for the analysis tests.

Each run's final exact KL follows from its arm and coefficient (fixed runs), its KL target (matched runs) or nothing
(no KL); its gold follows an over-optimisation curve of KL (Gao et al. 2022: gold = a sqrt(KL) - b KL, peak at
4 nats for grammar; a saturating accuracy curve for arithmetic), shifted per instance, plus noise. An arm can be
planted to restrain less, to gain or lose gold, to crash past a KL level (late collapse), or to ignore its KL
controller (not steerable); single runs can be planted to miss their KL target.

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


def _write(root: Path, rel: Path, summary: dict, ev: pd.DataFrame) -> None:
    d = root / rel
    d.mkdir(parents=True, exist_ok=True)
    ev.to_csv(d / "evals.csv", index=False)
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
) -> list[ExpectedRun]:
    """Writes every run of a synthetic grid under ``root``; returns the expected runs. ``misses``: (arm, target,
    instance, seed) runs that end 60% above their target; ``curves(task, kl)`` replaces the gold-vs-KL curves."""
    arms = CROSSED if arms is None else arms
    behaviours = behaviours or {}
    rng = np.random.default_rng(rng_seed)
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
                _write(root, rel, summary, ev)
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
    """A sample report: grammar with a planted late collapse of loss_k1 and a non-restraining old-policy arm,
    arithmetic with no planted difference; 6 instances x 1 seed."""
    from ablations import analysis

    root = out / "synthetic"
    arms = {**CROSSED, "old_loss_k2": spec("loss", "k2", target="old_policy")}
    beh = {
        "loss_k1": Behaviour(restraint=0.05, crash_above=12.0, steerable=False, length_offset=1.5),
        "old_loss_k2": Behaviour(restraint=0.2),
        "loss_k2": Behaviour(length_offset=0.8),
    }
    expected = write_runs(root, task="grammar", arms=arms, behaviours=beh, misses={("reward_k2", 8.0, 3, 0)})
    expected += write_runs(root, task="arithmetic", arms=CROSSED, rng_seed=1, targets=(2.0, 6.0))
    from ablations.lock import protocol_lock

    lock = protocol_lock(".", ("analysis", "grid.coefs", "grid.kl_targets"), {r.stage for r in expected})
    return analysis.run(protocol(("grammar", "arithmetic")), expected, out / "reports", root, lock)


if __name__ == "__main__":
    for p in sample(Path(sys.argv[1] if len(sys.argv) > 1 else "tmp/sample")):
        print(p)

"""Level and power of protocol v4's decision rule (exact sign test of the median, ablations/rule.py) against v3's
(sign-flip test of the mean) on each v3 primary question's OWN per-instance differences, skew kept; and the
sample-size plan (the cap for 80% power to settle a 2-margin difference) for those residuals.

    python benchmarks/skew_simulation.py                       # the table and the plans (about a minute)
    python benchmarks/skew_simulation.py --sims 20000          # tighter Monte Carlo SEs
    python benchmarks/skew_simulation.py --extract             # rebuild the fixture from docs/protocol-v3/

The fixture tests/ablations/data/v3_differences.csv holds, per task, question (Q2, Q3, Q4) and evaluation instance
(100-123), the difference d, the margin-sized control c and the no-KL contrast e on final gold, with the margin and
the calibrated directions of protocol/<task>.json at v3 (its note: tests/ablations/data/v3_differences.md).
Design of the simulation: ablations/simulate.py. Writes benchmarks/out/skew_simulation.json (git-ignored).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import pandas as pd
from scipy import stats

from ablations import rule as R
from ablations import simulate as S

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "ablations" / "data" / "v3_differences.csv"
OUT = Path(__file__).resolve().parent / "out"
# v3's primaries (params.yaml analysis.primary at commit f448ff4) with protocol/<task>.json's roles: (arm, role, kind)
V3 = {
    "Q2": (("loss_k3", "coef", "fixed"), ("reward_k3", "coef", "fixed")),
    "Q3": (("loss_k3", "target", "matched"), ("reward_k3", "target", "matched")),
    "Q4": (("loss_k3", "tuned", "fixed"), ("reward_k1", "coef", "fixed")),
}
CONTROL = (("reward_k1", "coef", "fixed"), ("reward_k1", "control", "fixed"))
NO_KL = (("none", None, "baseline"), ("reward_k1", "coef", "fixed"))


V3_RECORD = Path("docs/protocol-v3")


def extract() -> pd.DataFrame:
    """The fixture from v3's record (docs/protocol-v3: its reports and protocol files), per instance with PPO seeds
    averaged as ablations/primary.py does."""
    rows = []
    for task in ("grammar", "arithmetic"):
        runs = pd.read_csv(ROOT / V3_RECORD / task / "runs.csv")
        proto = json.loads((ROOT / V3_RECORD / task / "protocol.json").read_text())

        def diff(pair, runs=runs):
            (a, b) = (
                runs[(runs.arm == arm) & (runs.kind == kind) & ((runs.role == role) if role else True)]
                .groupby("instance")
                .final_gold.mean()
                for arm, role, kind in pair
            )
            return a - b

        c, e = diff(CONTROL), diff(NO_KL)
        for q, pair in V3.items():
            d = diff(pair)
            const = {
                "margin": proto["margins"]["gold"],
                "c_direction": proto["control_direction"]["gold"],
                "e_direction": proto["no_kl_direction"]["gold"],
            }
            for i in d.index:
                rows.append({"task": task, "question": q, "instance": int(i), "d": d[i], "c": c[i], "e": e[i], **const})
    return pd.DataFrame(rows)


def comparisons(frame: pd.DataFrame, checks: bool = True) -> dict[str, S.Comparison]:
    """One Comparison per task/question; the no-KL check on gold uses the gold margin. ``checks`` False: no
    control and no no-KL check (the test alone)."""
    out = {}
    for (task, q), g in frame.groupby(["task", "question"], sort=False):
        m = float(g.margin.iloc[0])
        kw = {}
        if checks:
            kw = {"control": g.c.to_numpy(), "control_direction": int(g.c_direction.iloc[0]), "nokl": g.e.to_numpy()}
            kw |= {"nokl_direction": int(g.e_direction.iloc[0]), "nokl_margin": m}
        out[f"{task} {q}"] = S.Comparison(g.d.to_numpy(), m, **kw)
    return out


def describe(frame: pd.DataFrame) -> pd.DataFrame:
    """Per question: n, mean, median, SD (in margins) and skewness of d (scipy.stats.skew, Fisher-Pearson g1)."""
    rows = {}
    for key, g in frame.groupby(["task", "question"], sort=False):
        d = g.d / g.margin.iloc[0]
        rows[key] = {"n": len(d), "mean/m": d.mean(), "median/m": d.median(), "sd/m": d.std(), "skew": stats.skew(d)}
    return pd.DataFrame.from_dict(rows, orient="index")


def fmt(r: dict) -> str:
    return f"{r['rate']:.4f} ± {r['se']:.4f}"


def table(records: list[dict]) -> dict[str, str]:
    """One row: the worst rate of each false claim over its Δ, and power at ±2m, formatted with SE."""
    row = {}
    for q in S.QUANTITIES:
        rs = [r for r in records if r["quantity"] == q]
        if not rs:
            continue
        if q.startswith("power"):
            for r in rs:
                row[f"{q} {r['delta']:+g}m"] = fmt(r)
        else:
            worst = max(rs, key=lambda r: r["rate"])
            row[f"{q} (worst, at Δ)"] = f"{fmt(worst)} ({worst['delta']:+g}m)"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--extract", action="store_true", help="rebuild the fixture from docs/protocol-v3/")
    ap.add_argument("--fixture", type=Path, default=FIXTURE, help="the residuals (default: the committed fixture)")
    ap.add_argument("--sims", type=int, default=4000, help="trials per Δ (new rule)")
    ap.add_argument("--old-sims", type=int, default=2000, help="trials per Δ (v3 rule; 0 to skip)")
    ap.add_argument("--plan-sims", type=int, default=2000, help="trials per cap in the sample-size plan")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--k", type=int, nargs="+", default=[9, 5], help="numbers of comparisons sharing alpha")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--caps", type=int, nargs="+", default=[24, 48], help="caps of the level table")
    ap.add_argument("--max-cap", type=int, default=200, help="largest cap the plan may choose")
    ap.add_argument("--questions", nargs="*", help='e.g. "arithmetic Q3" (default: all six)')
    ap.add_argument("--smoke", action="store_true", help="one question, tiny sizes (the test of this script)")
    args = ap.parse_args()
    if args.smoke:
        args.sims, args.old_sims, args.plan_sims, args.k, args.caps, args.max_cap = 100, 50, 50, [9], [12], 12
        args.questions = ["arithmetic Q3"]
    if args.extract:
        frame = extract()
        args.fixture.parent.mkdir(parents=True, exist_ok=True)
        frame.to_csv(args.fixture, index=False, float_format="%.17g")
        print(f"wrote {args.fixture} ({len(frame)} rows)")
    frame = pd.read_csv(args.fixture)
    print(describe(frame).round(3).to_string(), "\n")
    comps, bare = comparisons(frame), comparisons(frame, checks=False)
    names = args.questions or list(comps)
    out = {"args": vars(args), "level": [], "plan": []}
    t0 = time.perf_counter()
    for k in args.k:
        a_q = args.alpha / k
        for cap in args.caps:
            sch = R.Schedule(args.batch, cap, a_q)
            for name in names:
                runs = {
                    "v4 sign test, checks in": S.error_table(comps[name], sch, n_sims=args.sims),
                    "v4 sign test, no checks": S.error_table(bare[name], sch, n_sims=args.sims),
                }
                if args.old_sims:
                    old = S.signflip_table(comps[name], args.batch, cap, a_q, n_sims=args.old_sims)
                    runs["v3 sign-flip mean, control in"] = old
                for rule, recs in runs.items():
                    row = {"K": k, "alpha_q": a_q, "cap": cap, "question": name, "rule": rule}
                    out["level"].append({**row, **table(recs), "records": recs})
    level = pd.DataFrame([{k: v for k, v in r.items() if k != "records"} for r in out["level"]])
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 30):
        print(level.to_string(index=False), "\n")
    for k in args.k:
        for name in names:
            p = S.plan_cap(
                comps[name], args.alpha / k, batch_size=args.batch, max_cap=args.max_cap, n_sims=args.plan_sims
            )
            out["plan"].append({"K": k, "question": name, **p})
            print(
                f"plan K={k} {name}: cap {p['cap']} (at {p['at']}: power +2m {p['power_pos']:.3f}, "
                f"-2m {p['power_neg']:.3f}, equivalent at 0 {p['power_equivalent']:.3f})"
            )
    print(f"\n{time.perf_counter() - t0:.1f} s")
    OUT.mkdir(exist_ok=True)
    (OUT / "skew_simulation.json").write_text(json.dumps(out, indent=1, default=str))
    print(f"wrote {OUT / 'skew_simulation.json'}")


if __name__ == "__main__":
    main()

"""Compare the output hashes of two dvc.lock files: the proof that a change keeps every output bit.

    python benchmarks/compare_lock.py OLD NEW [--stages GLOB ...] [--ignore PATH_GLOB ...]
    python benchmarks/compare_lock.py git:main dvc.lock          # OLD from a git revision's dvc.lock

A proof on a sample of stages, from an empty workspace (no DVC cache needed; ~12 CPU-min): the chains of one
calibration and one evaluation instance per task (data, sft, rm, eval0), then cells of each kind on them (the no-KL
baselines, fixed coefficients, both placements under the adaptive controller: the ``target`` design cells), then
the comparison:

    export PATH=$PWD/.venv/bin:$PATH
    dvc repro grammar_calibration_eval0@0 arithmetic_calibration_eval0@0 grammar_eval0@100 arithmetic_eval0@100
    dvc repro -s grammar_calibration_baseline@0-0 'grammar_calibration@0-reward_k1-0.03-0' \
        grammar_baseline@100-0 'grammar_design@100-reward_k1-coef-0' 'grammar_design@100-loss_k3-coef-0' \
        'grammar_design@100-reward_k3-target-0' 'grammar_design@100-loss_k3-target-0' \
        arithmetic_calibration_baseline@0-0 'arithmetic_calibration@0-loss_k3-0.3-0' \
        arithmetic_baseline@100-0 'arithmetic_design@100-reward_k1-coef-0' 'arithmetic_design@100-loss_k3-coef-0' \
        'arithmetic_design@100-reward_k3-target-0' 'arithmetic_design@100-loss_k3-target-0'
    python benchmarks/compare_lock.py git:main dvc.lock

For every stage present in both files: identical (every out's md5 equal), or the outs that differ. Stages in only
one file are counted (a run of a subset leaves the others out). Exit status 1 if any compared out differs.
"""

from __future__ import annotations

import argparse
import fnmatch
import subprocess
import sys

import yaml


def load(spec: str) -> dict:
    """A dvc.lock's stages: a path, or ``git:<rev>`` for that revision's dvc.lock."""
    if spec.startswith("git:"):
        text = subprocess.run(["git", "show", f"{spec[4:]}:dvc.lock"], check=True, capture_output=True, text=True)
        text = text.stdout
    else:
        with open(spec) as f:
            text = f.read()
    return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)).get("stages", {})


def outs(stage: dict) -> dict[str, str]:
    """out path -> md5 (a directory's .dir hash; a file's md5)."""
    return {o["path"]: o.get("md5") for o in stage.get("outs", [])}


def compare(old: dict, new: dict, stages: list[str], ignore: list[str]) -> dict:
    pick = lambda name: not stages or any(fnmatch.fnmatch(name, s) for s in stages)
    common = sorted(s for s in old.keys() & new.keys() if pick(s))
    differ = {}
    for s in common:
        a, b = outs(old[s]), outs(new[s])
        bad = sorted(
            p for p in a.keys() | b.keys() if a.get(p) != b.get(p) and not any(fnmatch.fnmatch(p, g) for g in ignore)
        )
        if bad:
            differ[s] = bad
    return {
        "compared": len(common),
        "identical": len(common) - len(differ),
        "differ": differ,
        "only_old": sum(1 for s in old if s not in new and pick(s)),
        "only_new": sorted(s for s in new if s not in old and pick(s)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("old", nargs="?")
    ap.add_argument("new", nargs="?")
    ap.add_argument("--self-test", action="store_true", help="compare two built-in toy locks (the smoke test)")
    ap.add_argument("--stages", nargs="*", default=[], help="stage-name globs to compare (default: all)")
    ap.add_argument("--ignore", nargs="*", default=[], help="out-path globs to leave out of the comparison")
    args = ap.parse_args(argv)
    if args.self_test:
        return self_test()
    if not (args.old and args.new):
        ap.error("give OLD and NEW (or --self-test)")
    r = compare(load(args.old), load(args.new), args.stages, args.ignore)
    print(f"compared {r['compared']} stages: {r['identical']} identical, {len(r['differ'])} differ")
    for s, paths in r["differ"].items():
        print(f"  DIFFER {s}: {', '.join(paths)}")
    if r["only_new"]:
        more = " ..." if len(r["only_new"]) > 5 else ""
        print(f"only in new: {len(r['only_new'])} ({', '.join(r['only_new'][:5])}{more})")
    print(f"only in old: {r['only_old']}")
    return 1 if r["differ"] else 0


def self_test() -> int:
    """Two toy locks: one stage identical, one with a changed out, one only in each; the counts must be found."""
    out = lambda md5: {"outs": [{"path": "a", "md5": md5}]}
    old = {"same": out("1"), "changed": out("2"), "gone": out("3")}
    new = {"same": out("1"), "changed": out("9"), "added": out("4")}
    r = compare(old, new, [], [])
    assert (r["compared"], r["identical"], r["differ"], r["only_old"], r["only_new"]) == (
        2, 1, {"changed": ["a"]}, 1, ["added"]
    ), r  # fmt: skip
    assert compare(old, new, [], ["a"])["differ"] == {}
    print("self-test passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())

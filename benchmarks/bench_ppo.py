"""PPO speed of this tree against a baseline commit, in one benchmark run, with and without the CPU pin.

    python benchmarks/bench_ppo.py [--repeats 3] [--baseline aa745cb] [--profile]

Every measurement is a fresh process (one torch thread) doing one default-length PPO run of params.yaml's
reference arm at its middle coefficient: 60 iterations, a held-out evaluation every 5. It reports the CPU time of
each PPO iteration (process time between iteration callbacks; the iterations that include an evaluation, and
the first, are left out) and the whole run's wall and CPU time. The four variants, baseline or this tree x CPU
pin off or on (pipelines/cpu.py; the baseline gets the same environment variables), run in rotating order
``repeats`` times; the table gives the median over repeats of each run's median iteration, and the ratios.
CPU time rather than wall time: the development machine is shared, and CPU time is what contention distorts
least. The baseline is ``git archive <commit>`` unpacked in a temporary directory and imported in its own
processes (PYTHONPATH); both trees get the same resolved configuration (read here, from this tree's
params.yaml). Models are seeded fresh initialisations, not trained ones: every tensor shape of a PPO iteration is
fixed (responses are padded to max_new_tokens), so the cost does not depend on the weights.
``--compile`` adds a fifth variant, this tree pinned with ``torch.compile`` (inductor, fixed shapes, compiled in
process so that its CPU time counts) on every teacher-forced forward of the rollout, the scoring and the minibatch
loss with its backward: the candidate issue 8 names, measured rather than adopted (README, "Why not 1.4×").
``--profile`` adds two torch.profiler runs, before (baseline, unpinned) and after (this tree, pinned): aten calls
per iteration (all, and top-level ones: those not called by another aten op) and the operators by self CPU time.
Results: stdout and benchmarks/out/bench_ppo.json (git-ignored); no tracked file is written.
"""

from __future__ import annotations

import argparse
import inspect
import itertools
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "bench_ppo.json"
BASELINE = "aa745cb"  # main before issue 8's speed work: Adam's per-tensor loop, NaN-filled new memory, no pin


def spec(iterations: int | None, d_model: int | None = None) -> dict:
    """The resolved workload, as plain JSON for both trees: grammar, model and PPO config of the reference cell
    (``iterations`` overrides params.yaml's, for a shorter benchmark; ``d_model`` the model width, e.g. 8 for the
    cost of an iteration with almost no arithmetic: what dispatch, autograd and Python cost per op)."""
    from _reference import reference

    from ablations.config import load_params

    p = load_params()
    ref = reference(p, "grammar")
    t = p.grammar.task
    grammar = dict(seed=0, **t.model_dump(exclude={"n_demos", "n_train_prompts", "n_eval_prompts"}))
    return {
        "grammar": grammar,
        "prompts": [t.n_train_prompts, t.n_eval_prompts],
        "model": p.grammar.model.model_dump(include={"d_model", "n_layers", "n_heads"})
        | ({"d_model": d_model} if d_model else {}),
        "ppo": ref.config.model_dump(mode="json") | ({"iterations": iterations} if iterations else {}),
        "arm": ref.name,
    }


def child(workload: dict, profile: bool, compiled: bool = False) -> dict:
    """One PPO run in this process, with whichever tree PYTHONPATH points at (``compiled``: see ``compile_ppo``)."""
    import pipelines  # this tree pins the CPU math here, before torch; the baseline's package is empty

    # isort: split
    import copy
    import time

    import torch

    import rlhf
    from pipelines.common import setup
    from rlhf.config import PPOConfig
    from rlhf.grammar import make_grammar, sample_prompts
    from rlhf.model import ScalarModel, TinyLM
    from rlhf.ppo import train_ppo

    setup()
    if compiled:
        compile_ppo()
    # each tree gets the fields its own version knows (the baseline predates some)
    accepted = inspect.signature(make_grammar).parameters
    grammar = make_grammar(**{k: v for k, v in workload["grammar"].items() if k in accepted})
    g = torch.Generator().manual_seed(0)
    train, held = (sample_prompts(grammar, n, g) for n in workload["prompts"])
    torch.manual_seed(0)
    ref = TinyLM(grammar.vocab_size, grammar.prompt_len + grammar.max_new_tokens, **workload["model"]).eval()
    reward_model = ScalarModel(copy.deepcopy(ref)).eval()
    ppo, ignored = known_fields(PPOConfig, workload["ppo"])
    cfg = PPOConfig(**ppo)
    marks = []
    tick = lambda: marks.append(time.process_time())
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity, schedule

        prof = torch.profiler.profile(
            activities=[ProfilerActivity.CPU], schedule=schedule(wait=1, warmup=1, active=2, repeat=1)
        )
        prof.start()
        cfg = cfg.model_copy(update={"iterations": 5, "eval_every": 5})  # profiled: 3, 4
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    train_ppo(
        copy.deepcopy(ref), ref, reward_model, grammar, train, held, cfg, lambda row: (tick(), prof and prof.step())
    )
    out = {
        "tree": str(Path(rlhf.__file__).parents[1]),
        "pipelines": str(Path(pipelines.__file__).parent),
        "capability": torch.backends.cpu.get_cpu_capability(),
        "mkl_cbwr": os.environ.get("MKL_CBWR", "unset"),
        "run_wall_s": time.perf_counter() - start_wall,
        "run_cpu_s": time.process_time() - start_cpu,
        "ignored_fields": ignored,
    }
    evals = {it for it in range(1, cfg.iterations + 1) if it % cfg.eval_every == 0 or it == cfg.iterations}
    steps = [b - a for it, (a, b) in enumerate(itertools.pairwise(marks), start=2) if it not in evals]
    out["iteration_cpu_ms"] = 1e3 * statistics.median(steps)
    if prof is not None:
        prof.stop()
        out["profile"] = profile_summary(prof, iterations=2)
    return out


def compile_ppo() -> None:
    """torch.compile (inductor, static shapes) of rlhf.ppo's teacher-forced forwards (rollout log-probs, reference,
    values), its reward-model score and its minibatch loss (whose backward AOTAutograd compiles too); sampling stays
    eager. Compiled in this process (one compile thread) so that process time includes compiling; inductor's on-disk
    cache is warm after the first such run."""
    import torch
    import torch._inductor.config as inductor

    from rlhf import ppo

    inductor.compile_threads = 1
    for name in ("minibatch_loss", "response_logits", "response_values", "score"):
        setattr(ppo, name, torch.compile(getattr(ppo, name), dynamic=False))


def known_fields(model, values: dict, prefix: str = "") -> tuple[dict, dict]:
    """``values`` restricted to the fields ``model`` (a pydantic class of the tree under test) knows, recursing
    into nested models (the baseline's KLConfig predates some fields), and the dropped fields by dotted name."""
    kept, dropped = {}, {}
    for k, v in values.items():
        field = model.model_fields.get(k)
        if field is None:
            dropped[prefix + k] = v
        elif isinstance(v, dict) and inspect.isclass(field.annotation) and hasattr(field.annotation, "model_fields"):
            kept[k], sub = known_fields(field.annotation, v, f"{prefix}{k}.")
            dropped |= sub
        else:
            kept[k] = v
    return kept, dropped


def profile_summary(prof, iterations: int) -> dict:
    ev = prof.key_averages()
    aten = lambda name: name.startswith("aten::")
    top_level = [e for e in prof.events() if aten(e.name) and not (e.cpu_parent and aten(e.cpu_parent.name))]
    total = sum(e.self_cpu_time_total for e in ev)
    return {
        "aten_calls_per_iteration": sum(e.count for e in ev if aten(e.key)) / iterations,
        "aten_top_level_calls_per_iteration": len(top_level) / iterations,
        "fill_calls_per_iteration": sum(e.count for e in ev if e.key == "aten::fill_") / iterations,
        "top_self_cpu": [
            {"op": e.key, "share": round(e.self_cpu_time_total / total, 4), "calls_per_iteration": e.count / iterations}
            for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:15]
        ],
    }


def run_child(tree: Path, pinned: bool, workload: dict, profile: bool = False, compiled: bool = False) -> dict:
    from pipelines.cpu import PIN, PIN_ENV, THREADS_ENV, pin_env

    env = {k: v for k, v in os.environ.items() if k not in PIN and k != PIN_ENV}
    env |= {"PYTHONPATH": str(tree), THREADS_ENV: "1", PIN_ENV: "on" if pinned else "off"}
    env |= pin_env() if pinned else {}  # the baseline has no pin of its own: it gets the same variables
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(workload)]
    cmd += ["--profile"] * profile + ["--compile"] * compiled
    proc = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"benchmark child failed in {tree}:\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert Path(out["tree"]) == tree and Path(out["pipelines"]).parent == tree, out  # imported the intended tree
    return out


def unpack(commit: str, into: Path) -> Path:
    archive = subprocess.run(["git", "archive", "--format=tar", commit], cwd=ROOT, capture_output=True, check=True)
    tar = into / "baseline.tar"
    tar.write_bytes(archive.stdout)
    with tarfile.open(tar) as t:
        t.extractall(into / "tree", filter="data")
    return (into / "tree").resolve()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--baseline", default=BASELINE, help="commit to compare against")
    ap.add_argument("--iterations", type=int, help="PPO iterations per run (default: params.yaml's)")
    ap.add_argument("--d-model", type=int, help="model width (default: params.yaml's)")
    ap.add_argument("--profile", action="store_true", help="also profile one run per tree")
    ap.add_argument("--compile", action="store_true", help="also time this tree with torch.compile (pinned)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child), args.profile, args.compile)))
        return
    sys.path.insert(0, str(ROOT))  # this tree's packages, whatever the editable install points at
    workload = spec(args.iterations, args.d_model)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": unpack(args.baseline, Path(tmp)), "new": ROOT}
        variants = [(t, p, False) for t in trees for p in (False, True)] + [("new", True, True)] * args.compile
        runs = {v: [] for v in variants}
        for r in range(args.repeats):
            k = r % len(variants)
            for v in variants[k:] + variants[:k]:  # rotate the order: no variant always runs first
                runs[v].append(run_child(trees[v[0]], v[1], workload, compiled=v[2]))
                print(
                    f"  repeat {r + 1} {name(v)}: {runs[v][-1]['iteration_cpu_ms']:.1f} ms/iteration",
                    file=sys.stderr,
                    flush=True,
                )
        before_after = {"baseline pin off": ("baseline", False), "new pin on": ("new", True)} if args.profile else {}
        profiles = {n: run_child(trees[t], p, workload, profile=True)["profile"] for n, (t, p) in before_after.items()}
    result = summarise(runs, workload, args.baseline, args.repeats)
    result["profiles"] = profiles
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))


def name(variant: tuple[str, bool, bool]) -> str:
    tree, pinned, compiled = variant
    return f"{tree} pin {'on' if pinned else 'off'}" + " compiled" * compiled


def report(result: dict) -> str:
    """The result as a few lines of text (the JSON file has everything)."""
    head = f"{result['workload']} (model {result['model']}), baseline {result['baseline']}"
    lines = [f"{head}, {result['repeats']} repeats; CPU time:"]
    for name, v in result["variants"].items():
        each = ", ".join(f"{x:.1f}" for x in v["iteration_cpu_ms_each"])
        lines.append(
            f"  {name:16s} {v['iteration_cpu_ms']:7.1f} ms/iteration (runs: {each}); whole run {v['run_cpu_s']:.2f} s "
            f"CPU, {v['run_wall_s']:.1f} s wall; ATen {v['capability']}, MKL_CBWR {v['mkl_cbwr']}"
        )
    for name, v in result["variants"].items():
        if v["ignored_fields"]:
            lines.append(f"  {name}: config fields its tree does not know, left out: {v['ignored_fields']}")
    lines += [f"  {k}: {v:.3f}x" for k, v in result["speedup_per_iteration"].items()]
    lines.append(f"  whole run, baseline unpinned / new pinned: {result['speedup_whole_run_cpu']:.3f}x")
    for name, prof in result["profiles"].items():
        lines.append(
            f"  profile {name}: {prof['aten_top_level_calls_per_iteration']:.0f} top-level aten calls per iteration "
            f"({prof['aten_calls_per_iteration']:.0f} in all, fill_ {prof['fill_calls_per_iteration']:.0f}); top: "
            + ", ".join(f"{e['op']} {100 * e['share']:.1f}%" for e in prof["top_self_cpu"][:6])
        )
    return "\n".join(lines)


def summarise(runs: dict, workload: dict, baseline: str, repeats: int) -> dict:
    med = lambda v, k: statistics.median(r[k] for r in runs[v])
    table = {
        name(v): {
            "iteration_cpu_ms": med(v, "iteration_cpu_ms"),
            "run_cpu_s": med(v, "run_cpu_s"),
            "run_wall_s": med(v, "run_wall_s"),
            "capability": runs[v][0]["capability"],
            "mkl_cbwr": runs[v][0]["mkl_cbwr"],
            "ignored_fields": runs[v][0]["ignored_fields"],
            "iteration_cpu_ms_each": [round(r["iteration_cpu_ms"], 2) for r in runs[v]],
        }
        for v in runs
    }
    it = lambda name: table[name]["iteration_cpu_ms"]
    return {
        "workload": workload["arm"],
        "model": workload["model"],
        "baseline": baseline,
        "repeats": repeats,
        "variants": table,
        "speedup_per_iteration": {
            "pin off (baseline / new)": it("baseline pin off") / it("new pin off"),
            "pin on (baseline / new)": it("baseline pin on") / it("new pin on"),
            "net (baseline unpinned / new pinned)": it("baseline pin off") / it("new pin on"),
            "pin cost on new code (pinned / unpinned)": it("new pin on") / it("new pin off"),
        }
        | (
            {
                "torch.compile (baseline unpinned / new pinned compiled)": it("baseline pin off")
                / it("new pin on compiled")
            }
            if "new pin on compiled" in table
            else {}
        ),
        "speedup_whole_run_cpu": table["baseline pin off"]["run_cpu_s"] / table["new pin on"]["run_cpu_s"],
    }


if __name__ == "__main__":
    main()

"""CPU seconds per grid cell of this tree against a baseline commit: real cells, as their stages run them.

    python benchmarks/bench_cell.py [--baseline f448ff4] [--rounds 5] [--cells STAGE ...] [--inputs DIR]

Each measurement is a fresh process with one torch thread and the CPU pin (pipelines/cpu.py) running one cell's
stage function ``pipelines.ppo.run_cell`` (load, train, MLflow logging, outputs: what `python -m pipelines.ppo
<stage>` does after its imports, and what a runner worker does per cell) with the tree under test on PYTHONPATH,
in a scratch workspace of its own holding this tree's params.yaml and protocol/ and the instance's data and models.
Imports, ``setup()`` and the MLflow store's first opening happen before the clock starts (a runner worker pays them
once). Reported per cell and tree: the median and range over ``--rounds`` of the process CPU time of run_cell and of
train_ppo inside it; the trees run in rotating order in every round (interleaved: the shared machine's load falls
on both alike). The instance's data, SFT and reward model are built once (this tree's stage commands, or copied
from ``--inputs``: a workspace that has them) and shared; a stage a tree's upstream chain adds beyond those
(this tree's eval0: the iteration-0 evaluation, once per instance) runs once per tree and round, timed the same
way; the report adds its median CPU time divided by the instance's number of cells in params.yaml ("cell +
share"), the honest per-cell cost. It also checks that both trees wrote byte-identical outputs (summary.json,
evals.csv, history.csv, diagnostics.csv) in every round. The baseline is `git archive <commit>` unpacked in a
temporary directory. Results: stdout and benchmarks/out/bench_cell.json (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_ppo import unpack

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out" / "bench_cell.json"
BASELINE = "f448ff4"  # main before issue 28's cheaper cells and issue 30's one loop
CELLS = ["grammar_design@100-reward_k1-coef-0", "arithmetic_design@100-reward_k1-coef-0"]  # default grid cells
SHARED = ("data", "sft", "rm")  # upstream kinds built once for both trees (the same bits in both)
OUTPUTS = ("summary.json", "evals.csv", "history.csv", "diagnostics.csv")


def child(what: list[str]) -> dict:
    """In the tree on PYTHONPATH, cwd its workspace: ``["cell", stage]`` runs ``run_cell``; ``[kind, ..., task,
    instance]`` runs upstream stages ``pipelines.<kind>.main`` in order (as a runner worker does). CPU seconds out."""
    import pipelines  # the CPU pin before torch

    # isort: split
    from ablations.experiment import load_experiment
    from ablations.grid import find_cell
    from pipelines import ppo, tracking
    from pipelines.common import setup

    tracking.ROOT = Path.cwd()  # MLflow artifacts in the workspace, never in a checkout
    params = load_experiment()
    # before the clock, as a runner worker has done before its next stage: the MLflow store opened, and setup()
    # (torch.use_deterministic_algorithms imports torch._dynamo: about 1.5 CPU-s once per process)
    tracking.experiment_client(params.mlflow.experiment)
    setup()
    if what[0] != "cell":  # one or more upstream kinds, in order
        kinds, (task, instance) = what[:-2], what[-2:]
        start = time.process_time()
        for kind in kinds:
            importlib.import_module(f"pipelines.{kind}").main([task, instance])
        return {"cpu_s": time.process_time() - start}
    train_cpu, train_ppo = [], ppo.train_ppo

    def timed(*args, **kwargs):
        start = time.process_time()
        out = train_ppo(*args, **kwargs)
        train_cpu.append(time.process_time() - start)
        return out

    ppo.train_ppo = timed
    cell = find_cell(params, what[1])
    start = time.process_time()
    ppo.run_cell(params, cell)
    cpu = time.process_time() - start
    digest = {f: hashlib.md5((cell.out_dir / f).read_bytes()).hexdigest() for f in OUTPUTS}
    return {"cpu_s": cpu, "train_cpu_s": train_cpu[0], "outputs": digest, "tree": str(Path(pipelines.__file__).parent)}


def run_child(tree: Path, workspace: Path, what: list[str]) -> dict:
    from pipelines.cpu import THREADS_ENV

    env = {**os.environ, "PYTHONPATH": str(tree), THREADS_ENV: "1", "TQDM_DISABLE": "1", "MPLBACKEND": "Agg"}
    env["MLFLOW_TRACKING_URI"] = f"sqlite:///{workspace / 'mlflow.db'}"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(what)]
    proc = subprocess.run(cmd, cwd=workspace, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"benchmark child {what} failed in {tree}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "tree" not in out or Path(out["tree"]).parent == tree, out  # imported the tree under test
    return out


def instances(cells: list[str]) -> list[tuple[str, int, str]]:
    """(task, instance, prefix) of each cell's instance ("calibration_" for a calibration instance), once each."""
    from ablations.config import load_params
    from ablations.grid import find_cell

    params = load_params(ROOT / "params.yaml")
    found = {(c.task, c.instance, c.chain) for c in (find_cell(params, s) for s in cells)}
    return sorted(found)


def cells_per_instance(task: str, instance: int) -> int:
    from ablations.config import load_params
    from ablations.grid import cells

    return sum(c.task == task and c.instance == instance for c in cells(load_params(ROOT / "params.yaml")))


def extra_kinds(tree: Path, task: str, prefix: str) -> list[str]:
    """The upstream stage kinds of ``tree``'s chain for ``task`` beyond SHARED (this tree: eval0)."""
    code = (
        "from ablations.config import load_params; from ablations.grid import upstream_chains; import json; "
        "print(json.dumps(upstream_chains(load_params())))"
    )
    from pipelines.cpu import PIN_ENV

    env = {**os.environ, "PYTHONPATH": str(tree), PIN_ENV: "off"}  # cwd: the tree (`-c` puts it first on sys.path)
    out = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, check=True)
    kinds = []
    for chain in json.loads(out.stdout):
        group = chain[0].split("@")[0]
        if group == f"{task}_{prefix}data":
            kinds = [s.split("@")[0].removeprefix(f"{task}_{prefix}") for s in chain]
    return [k for k in kinds if k not in SHARED]


def workspace(root: Path, inputs: Path | None, needed: list[tuple[str, int, str]]) -> Path:
    """A directory with this tree's params.yaml and protocol/, and the data and models of the ``needed``
    instances: copied from ``inputs``, or built by this tree's stage commands."""
    root.mkdir(parents=True)
    shutil.copy(ROOT / "params.yaml", root / "params.yaml")
    if (ROOT / "protocol").is_dir():  # design cells read it
        shutil.copytree(ROOT / "protocol", root / "protocol")
    for task, instance, _ in needed:
        files = [Path("data") / task / str(instance) / "task.pt"]
        files += [Path("models") / task / str(instance) / f"{m}.pt" for m in ("sft", "rm")]
        if inputs is not None:
            for f in files:
                if (inputs / f).is_file():
                    (root / f).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy(inputs / f, root / f)
            continue
        from ablations.tasks import TASKS

        kinds = list(SHARED if TASKS[task].learned_reward else SHARED[:2])
        print(f"  building {', '.join(kinds)} of {task} {instance}", file=sys.stderr, flush=True)
        run_child(ROOT, root, [*kinds, task, str(instance)])
    return root


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", default=BASELINE, help="commit to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--cells", nargs="+", default=CELLS, help="cells' DVC stage names")
    ap.add_argument("--inputs", type=Path, help="a workspace with the instances' data/ and models/ (else built)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(json.loads(args.child))))
        return
    sys.path.insert(0, str(ROOT))  # this tree's packages, whatever the editable install points at
    needed = instances(args.cells)
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"baseline": unpack(args.baseline, Path(tmp)), "this tree": ROOT}
        shared = workspace(Path(tmp) / "shared", args.inputs, needed)
        spaces = {name: Path(tmp) / f"ws-{i}" for i, name in enumerate(trees)}
        for space in spaces.values():
            shutil.copytree(shared, space)
        extra = {n: {(t, i): extra_kinds(tree, t, p) for t, i, p in needed} for n, tree in trees.items()}
        runs = {(n, c): [] for n in trees for c in args.cells}
        stages = {(n, t, i, k): [] for n in trees for (t, i), ks in extra[n].items() for k in ks}
        names = list(trees)
        for r in range(args.rounds):
            for n in names[r % 2 :] + names[: r % 2]:  # rotate: no tree always first
                for t, i, _ in needed:
                    for k in extra[n][(t, i)]:
                        stages[(n, t, i, k)].append(run_child(trees[n], spaces[n], [k, t, str(i)])["cpu_s"])
                for c in args.cells:
                    runs[(n, c)].append(run_child(trees[n], spaces[n], ["cell", c]))
                    print(
                        f"  round {r + 1} {n} {c}: {runs[(n, c)][-1]['cpu_s']:.2f} CPU-s", file=sys.stderr, flush=True
                    )
    result = summarise(runs, stages, needed, args)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(report(result))


def stat(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "each": [round(x, 3) for x in xs]}


def summarise(runs: dict, stages: dict, needed: list, args) -> dict:
    from ablations.config import load_params
    from ablations.grid import find_cell

    params = load_params(ROOT / "params.yaml")
    out = {"baseline": args.baseline, "rounds": args.rounds, "cells": {}}
    for c in args.cells:
        cell = find_cell(params, c)
        n_cells = cells_per_instance(cell.task, cell.instance)
        row = {"cells_per_instance": n_cells, "trees": {}}
        for name in ("baseline", "this tree"):
            per = {
                k: stat(s) for (n, t, i, k), s in stages.items() if n == name and (t, i) == (cell.task, cell.instance)
            }
            share = sum(s["median"] for s in per.values()) / n_cells
            cell_cpu = stat([r["cpu_s"] for r in runs[(name, c)]])
            row["trees"][name] = {
                "cell_cpu_s": cell_cpu,
                "train_cpu_s": stat([r["train_cpu_s"] for r in runs[(name, c)]]),
                "instance_stages_cpu_s": per,
                "share_cpu_s": share,
                "cell_plus_share_cpu_s": cell_cpu["median"] + share,
            }
        b, a = row["trees"]["baseline"], row["trees"]["this tree"]
        row["ratio_cell"] = b["cell_cpu_s"]["median"] / a["cell_cpu_s"]["median"]
        row["ratio_cell_plus_share"] = b["cell_plus_share_cpu_s"] / a["cell_plus_share_cpu_s"]
        row["ratio_train"] = b["train_cpu_s"]["median"] / a["train_cpu_s"]["median"]
        digests = {json.dumps(r["outputs"], sort_keys=True) for n in ("baseline", "this tree") for r in runs[(n, c)]}
        row["outputs_identical"] = len(digests) == 1
        out["cells"][c] = row
    return out


def report(result: dict) -> str:
    lines = [
        f"CPU seconds per cell (one thread), {result['rounds']} interleaved rounds, baseline {result['baseline']}:"
    ]
    span = lambda s: f"{s['median']:.2f} [{s['min']:.2f}, {s['max']:.2f}]"
    for c, row in result["cells"].items():
        lines.append(f"  {c} ({row['cells_per_instance']} cells in its instance):")
        for name, t in row["trees"].items():
            stages = ", ".join(f"{k} {span(s)}" for k, s in t["instance_stages_cpu_s"].items())
            extra = f"; once per instance: {stages} -> {t['share_cpu_s']:.3f} per cell" if stages else ""
            lines.append(f"    {name:10s} cell {span(t['cell_cpu_s'])}, train_ppo {span(t['train_cpu_s'])}{extra}")
        lines.append(
            f"    baseline / this tree (medians): cell {row['ratio_cell']:.3f}x, cell + share "
            f"{row['ratio_cell_plus_share']:.3f}x, train_ppo {row['ratio_train']:.3f}x; outputs byte-identical in "
            f"every round: {'yes' if row['outputs_identical'] else 'NO'}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()

"""Do two x86 machines compute the same bits? Emulated on this one, with and without the CPU pin (issue 8, item 1).

    python benchmarks/cross_machine.py

A "machine" is emulated by capping what each math library may use (read when the library first runs, so each
configuration is a fresh process); unpinned rows run with RLHF_CPU_PIN=off:

    this machine            nothing capped (the development machine: AVX-512 with VNNI, BF16, FP16 and AMX)
    Cascade Lake            MKL_ENABLE_INSTRUCTIONS=AVX512_E1, ONEDNN_MAX_CPU_ISA=AVX512_CORE_VNNI
    Skylake-SP              MKL_ENABLE_INSTRUCTIONS=AVX512, ONEDNN_MAX_CPU_ISA=AVX512_CORE
    AVX2 machine            ATEN_CPU_CAPABILITY=avx2, MKL_ENABLE_INSTRUCTIONS=AVX2, ONEDNN_MAX_CPU_ISA=AVX2
                            (Haswell to Alder Lake, AMD Zen 1-3; ATen has one AVX-512 level, so only here does it move)

Three rows cap one library at a time on this machine, to show which library makes a difference; one gives a
Skylake-SP's MKL the reproducibility branch alone (MKL_CBWR=AVX2 without capping its dispatcher), which is why the
pin caps the dispatcher too. Pinned, every library is capped at AVX2 by the environment, whatever the CPU offers
(the pin overrides the emulation's variables), so a pinned run on any of these machines executes the AVX2
machine's code path: the table shows that a pinned run here equals the AVX2 machine's unpinned run, and itself
run to run. What an emulation cannot show is tuning by CPU model rather than ISA (cache sizes, which MKL's CNR
mode fixes; oneDNN is used only for the elementwise GELU).

Every configuration runs the pipeline's own code at reduced length (params.yaml with the step counts below): data,
SFT and reward model (build_upstream) and one PPO run of the reference arm at its middle coefficient
(train_ppo), and reports to full precision the SFT held-out NLL, the reward model's held-out accuracy and
correlations with gold, the PPO run's final held-out metrics, and a hash of the final policy weights. ``--full``
runs params.yaml's full lengths for three rows (this machine and the AVX2 machine unpinned, pinned): how far
apart the machines end. Prints a table; writes benchmarks/out/cross_machine[_full].json (git-ignored).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "benchmarks" / "out"
REDUCED = {"sft": {"steps": 300}, "rm": {"steps": 300}, "ppo": {"iterations": 20}}  # SFT/RM: 800, PPO: 60
AVX2 = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CASCADE_LAKE = {"MKL_ENABLE_INSTRUCTIONS": "AVX512_E1", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_VNNI"}
SKYLAKE = {"MKL_ENABLE_INSTRUCTIONS": "AVX512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}
CNR_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
CONFIGS = {  # name: (pinned, environment)
    "this machine, unpinned": (False, {}),
    "Cascade Lake, unpinned": (False, CASCADE_LAKE),
    "Skylake-SP, unpinned": (False, SKYLAKE),
    "AVX2 machine, unpinned": (False, AVX2),
    "this machine, ATen capped at AVX2 only": (False, {"ATEN_CPU_CAPABILITY": "avx2"}),
    "this machine, MKL capped at AVX2 only": (False, {"MKL_ENABLE_INSTRUCTIONS": "AVX2"}),
    "this machine, oneDNN capped at AVX2 only": (False, {"ONEDNN_MAX_CPU_ISA": "AVX2"}),
    "Skylake-SP, pin without MKL's dispatcher cap": (False, {**CNR_ONLY, "MKL_ENABLE_INSTRUCTIONS": "AVX512"}),
    "pinned (any of these machines)": (True, {}),
    "pinned, again": (True, {}),
}
FULL_ROWS = ("this machine, unpinned", "AVX2 machine, unpinned", "pinned (any of these machines)")
LIBRARY_ENV = ("ATEN_CPU_CAPABILITY", "MKL_CBWR", "MKL_ENABLE_INSTRUCTIONS", "ONEDNN_MAX_CPU_ISA")


def child(full: bool) -> dict:
    """The (reduced, unless ``full``) pipeline in this process, under whatever the environment caps."""
    import pipelines  # noqa: F401  (pins the CPU math unless RLHF_CPU_PIN=off)

    # isort: split
    import copy

    import torch
    from _reference import reference

    from ablations.config import load_params
    from pipelines.common import setup
    from pipelines.cpu import settings
    from pipelines.upstream import build_upstream
    from rlhf.ppo import train_ppo

    device = setup()
    p = load_params()
    if not full:
        section = p.grammar.model_copy(
            update={k: getattr(p.grammar, k).model_copy(update=v) for k, v in REDUCED.items()}
        )
        p = p.model_copy(update={"grammar": section})
    task, grammar, sft_model, reward_model, metrics = build_upstream(p, "grammar", 0, device)
    ref = reference(p, "grammar")
    policy = copy.deepcopy(sft_model)
    out = train_ppo(
        policy,
        sft_model,
        reward_model,
        grammar,
        task["train_prompts"],
        task["eval_prompts"],
        ref.config,
    )
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in policy.state_dict().values())).hexdigest()
    s = out["summary"]
    return {
        "sft heldout_nll_before": metrics["sft"]["heldout_nll_before"],
        "sft heldout_nll": metrics["sft"]["heldout_nll"],
        "rm heldout_accuracy": metrics["rm"]["heldout_accuracy"],
        "rm pearson_gold": metrics["rm"]["pearson_gold"],
        "rm spearman_gold": metrics["rm"]["spearman_gold"],
        "ppo final_gold": s["final_gold"],
        "ppo final_kl": s["final_kl"],
        "ppo final_proxy": s["final_proxy"],
        "ppo policy sha256": digest[:16],
        "settings": settings(),
        "stage": ref.name,
        "torch_version": torch.__version__,
    }


def run(pinned: bool, extra: dict, full: bool) -> dict:
    from pipelines.cpu import PIN, PIN_ENV, THREADS_ENV

    env = {k: v for k, v in os.environ.items() if k not in (*PIN, *LIBRARY_ENV, PIN_ENV)}
    env |= extra | {"PYTHONPATH": str(ROOT), THREADS_ENV: "1", PIN_ENV: "on" if pinned else "off"}
    env["TQDM_DISABLE"] = "1"
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child"] + ["--full"] * full
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if proc.returncode:
        sys.exit(f"configuration {extra} (pinned={pinned}) failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def table(results: dict) -> str:
    keys = [k for k in next(iter(results.values())) if k not in ("settings", "stage", "torch_version")]
    ref = results["pinned (any of these machines)"]
    lines = ["| configuration | " + " | ".join(keys) + " | ATen / MKL CNR | = pinned? |"]
    lines.append("|---" * (len(keys) + 3) + "|")
    for name, r in results.items():
        cells = " | ".join(repr(r[k]) for k in keys)
        same = all(r[k] == ref[k] for k in keys)
        lines.append(
            f"| {name} | {cells} | {r['settings']['aten_cpu_capability']} / {r['settings']['mkl_cbwr']} | "
            f"{'yes' if same else 'no'} |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="params.yaml's full lengths, for the three key rows only")
    ap.add_argument(
        "--smoke", action="store_true", help="one pinned row at params.yaml's lengths (a test that it runs)"
    )
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.full = args.full or args.smoke
    if args.child:
        print(json.dumps(child(args.full)))
        return
    sys.path.insert(0, str(ROOT))
    rows = ("pinned (any of these machines)",) if args.smoke else FULL_ROWS if args.full else tuple(CONFIGS)
    configs = {k: CONFIGS[k] for k in rows}
    results = {}
    for name, (pinned, extra) in configs.items():
        results[name] = run(pinned, extra, args.full)
        print(f"  {name}: SFT NLL {results[name]['sft heldout_nll']!r}", file=sys.stderr, flush=True)
    OUT.mkdir(parents=True, exist_ok=True)
    out = OUT / f"cross_machine{'_full' * args.full}.json"
    out.write_text(json.dumps({"reduced": None if args.full else REDUCED, "results": results}, indent=2) + "\n")
    print(table(results))


if __name__ == "__main__":
    main()

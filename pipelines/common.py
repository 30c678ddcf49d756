"""What every stage script shares: paths, threads and determinism, checkpoints, atomic outputs."""

from __future__ import annotations

import json
import os
import shutil
import uuid
import zlib
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from ablations.section import PACKAGED, ModelParams
from pipelines import cpu
from pipelines.cpu import THREADS_ENV
from rlhf.model import ScalarModel, TinyLM, default_device
from rlhf.task import Task
from rlhf.tasks import task_from_state


# Where each stage's outputs live (dvc.yaml writes the same paths; the e2e tests run both).
def data_path(task: str, instance: int) -> Path:
    return Path("data") / task / str(instance) / "task.pt"


def model_path(task: str, instance: int, name: str) -> Path:
    """models/<task>/<instance>/<name>.pt, name 'sft' or 'rm'."""
    return Path("models") / task / str(instance) / f"{name}.pt"


def eval0_path(task: str, instance: int) -> Path:
    """models/<task>/<instance>/eval0.json: the instance's iteration-0 evaluation (pipelines/eval0.py)."""
    return Path("models") / task / str(instance) / "eval0.json"


def pretrained_path(name: str) -> Path:
    """models/pretrained/<name>: packaged model ``name``, converted by stage pretrained@<name>."""
    return Path("models") / "pretrained" / name


def metrics_path(task: str, instance: int, name: str) -> Path:
    return Path("metrics") / task / str(instance) / f"{name}.json"


def derived_seed(seed: int, salt: str) -> int:
    """A seed of its own for each use of an instance seed (CRC-32 of "salt:seed"): e.g. the reward model's prompts
    are not the data stage's prompts drawn again."""
    return zlib.crc32(f"{salt}:{seed}".encode())


def upstream_stage_args(argv: list[str] | None, stage: str):
    """`python -m pipelines.<stage> <task> <instance>`: validates params.yaml and the arguments; returns
    (params, task name, task section, instance). Exits with one line on a bad argument or params.yaml."""
    import sys

    from ablations.experiment import ParamsError, load_experiment

    args = sys.argv[1:] if argv is None else argv
    try:
        params = load_experiment()
    except ParamsError as e:
        sys.exit(f"error: {e}")
    tasks = params.tasks()
    seeds = {t: [*s.calibration.instances, *s.calibration.plan_instances, *s.instances] for t, s in tasks.items()}
    if len(args) != 2 or args[0] not in tasks or not args[1].isdigit() or int(args[1]) not in seeds[args[0]]:
        allowed = "; ".join(f"{t} {{{', '.join(map(str, s))}}}" for t, s in seeds.items())
        sys.exit(f"usage: python -m pipelines.{stage} <task> <instance>; allowed: {allowed} (got {' '.join(args)!r})")
    return params, args[0], tasks[args[0]], int(args[1])


def upstream_stage_name(task: str, section, stage: str, instance: int) -> str:
    """DVC's name of upstream stage ``stage`` of ``task``'s ``instance``: ``<task>_calibration_<stage>@<i>``,
    ``<task>_plan_<stage>@<i>`` or ``<task>_<stage>@<i>`` (its MLflow run is found by it)."""
    cal = section.calibration
    chain = "calibration_" if instance in cal.instances else "plan_" if instance in cal.plan_instances else ""
    return f"{task}_{chain}{stage}@{instance}"


def setup() -> torch.device:
    """Deterministic torch with an explicit thread count (env RLHF_THREADS, default 1), on the pinned CPU code path;
    CUDA when present, with cuBLAS's deterministic workspace.

    Deterministic algorithms stay on; filling new memory with NaN (a debugging aid of deterministic mode, ~5,000
    fill_ calls per PPO iteration) is off: every tensor the code reads it has written first, and two runs with
    the same seed are bit-identical (tests/test_determinism.py). ``cpu.check`` fails if the CPU pin did not take
    effect (torch imported before pipelines) and warns if this CPU cannot follow it."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = False
    cpu.check()
    return default_device()


@contextmanager
def atomic_dir(path: Path):
    """Yields a temporary sibling directory that replaces ``path`` only if the block finishes.

    An interrupted stage leaves no half-written output that DVC or the analysis could take as complete."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.mkdir(parents=True)
    try:
        yield tmp
        old = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
        if path.exists():  # renamed aside, never left half-deleted; a kill before the rmtree leaves `old` behind
            os.rename(path, old)  # for pipelines.leftovers.clean_temp
        os.replace(tmp, path)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def write_atomic(path: Path, data: bytes | str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(tmp, path)


def write_json(path: Path, obj: dict) -> None:
    write_atomic(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def save_checkpoint(path: Path, obj: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file (one line)."""


def load_checkpoint(path: Path) -> dict:
    """``torch.load`` with ``weights_only=True``; CheckpointError naming the file if it is missing or unreadable
    (truncated, not a checkpoint)."""
    try:
        return torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; run `dvc repro` to create it") from None
    except Exception as e:  # torch raises RuntimeError, OSError, EOFError or UnpicklingError for a damaged file
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"{path}: cannot load checkpoint ({type(e).__name__}: {reason}); it is damaged or not a checkpoint: "
            "re-create it with `dvc repro`"
        ) from None


def load_task(data: dict) -> Task:
    """The task instance a data/<task>/<i>/task.pt holds."""
    return task_from_state(data["task"])


def eval_sets(data: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The held-out prompt sets of a task instance: {"": in-domain, "ood": out-of-domain if the task has one}."""
    sets = {"": data["eval_prompts"], "ood": data.get("ood_prompts")}
    return {k: v.to(device) for k, v in sets.items() if v is not None}


def new_lm(arch: dict) -> nn.Module:
    """A randomly initialised model of the architecture a checkpoint records (tiny, or hf: ``rlhf.hf.arch``)."""
    if arch.get("backend") == "hf":
        from rlhf import hf  # transformers only when an hf model is used

        return hf.from_arch(arch)
    return TinyLM(arch["vocab_size"], arch["max_len"], arch["d_model"], arch["n_layers"], arch["n_heads"])


def build_lm(model: ModelParams, vocab_size: int, max_len: int) -> tuple[nn.Module, dict]:
    """A freshly initialised (tiny or hf from-config) or pretrained (hf) language model for the task's vocabulary,
    and the ``arch`` its checkpoints record. Initialisation uses torch's global RNG (seed it first)."""
    if model.backend == "tiny":
        arch = {
            "vocab_size": vocab_size,
            "max_len": max_len,
            **model.model_dump(include={"d_model", "n_layers", "n_heads"}),
        }
        return new_lm(arch), arch
    from rlhf import hf

    h = model.hf
    if h.pretrained is not None:
        path = pretrained_path(h.pretrained) if h.pretrained in PACKAGED else h.pretrained
        if h.pretrained in PACKAGED and not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} not found: convert it first (dvc repro pretrained@{h.pretrained})")
        ids = hf.token_ids_from_tokenizer(path, h.tokens) if h.tokens is not None else None
        lm = hf.from_pretrained(path, ids)
    else:
        lm = hf.from_config(
            h.family, vocab_size, max_len, model.d_model, model.n_layers, model.n_heads, h.intermediate_size
        )
    return lm, hf.arch(lm)


def set_precision(model: ModelParams, *modules: nn.Module) -> None:
    """bf16 autocast for hf models when params.yaml asks for it (fp32 weights, fp32 logits and KL math)."""
    if model.backend == "hf" and model.hf.bf16:
        from rlhf import hf

        for m in modules:
            hf.set_autocast(m, torch.bfloat16)


def load_lm(path: Path, device: torch.device) -> TinyLM:
    ckpt = load_checkpoint(path)
    model = new_lm(ckpt["arch"])
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def load_reward_model(path: Path, device: torch.device) -> ScalarModel:
    ckpt = load_checkpoint(path)
    model = ScalarModel(new_lm(ckpt["arch"]))
    model.load_state_dict(ckpt["state_dict"])
    return model.to(device).eval()


def load_instance(task: str, instance: int, model: ModelParams, learned_reward: bool, device: torch.device):
    """What every cell of a task instance starts from, on ``device`` at the precision ``model`` asks for
    (``set_precision``): (data, task, SFT model, reward model: None for a task scored by its verifier)."""
    data = load_checkpoint(data_path(task, instance))
    sft = load_lm(model_path(task, instance, "sft"), device)
    reward_model = load_reward_model(model_path(task, instance, "rm"), device) if learned_reward else None
    set_precision(model, *[m for m in (sft, reward_model) if m is not None])
    return data, load_task(data), sft, reward_model

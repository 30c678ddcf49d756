"""What every stage script shares: paths, threads and determinism, checkpoints, atomic outputs."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from pipelines import cpu
from rlhf.model import ScalarModel, TinyLM, default_device
from rlhf.task import Grammar

DATA = Path("data/task.pt")
SFT_MODEL = Path("models/sft.pt")
RM_MODEL = Path("models/rm.pt")
METRICS = Path("metrics")
THREADS_ENV = "RLHF_THREADS"


def setup() -> torch.device:
    """Deterministic torch with an explicit thread count (env RLHF_THREADS, default 1), on the pinned CPU code path.

    Deterministic algorithms stay on; filling new memory with NaN (a debugging aid of deterministic mode, ~5,000
    fill_ calls per PPO iteration) is off: every tensor the code reads it has written first, and two runs with
    the same seed are bit-identical (tests/test_determinism.py). ``cpu.check`` fails if the CPU pin did not take
    effect (torch imported before pipelines) and warns if this CPU cannot follow it."""
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
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
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


def load_checkpoint(path: Path) -> dict:
    return torch.load(path, weights_only=True, map_location="cpu")


def load_grammar(task: dict) -> Grammar:
    return Grammar(**task["grammar"])


def new_lm(arch: dict) -> TinyLM:
    return TinyLM(arch["vocab_size"], arch["max_len"], arch["d_model"], arch["n_layers"], arch["n_heads"])


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

"""What every stage script shares: paths, threads and determinism, checkpoints, atomic outputs."""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path

import torch

from rlhf.model import ScalarModel, TinyLM, default_device
from rlhf.task import Grammar

DATA = Path("data/task.pt")
SFT_MODEL = Path("models/sft.pt")
RM_MODEL = Path("models/rm.pt")
METRICS = Path("metrics")
THREADS_ENV = "RLHF_THREADS"


def setup() -> torch.device:
    """Deterministic torch with an explicit thread count (env RLHF_THREADS, default 1)."""
    torch.set_num_threads(int(os.environ.get(THREADS_ENV, "1")))
    torch.use_deterministic_algorithms(True)
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

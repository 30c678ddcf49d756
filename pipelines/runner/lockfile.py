"""dvc.lock kept whole, and the one module of the runner that uses DVC's internals (everything else calls DVC's
command line through ``main`` here).

DVC rewrites dvc.lock in place (``open(path, "w+")`` then a YAML dump: ``_dump_data`` in
dvc/utils/serialize/_common.py, DVC 3.x), so a process killed or interrupted during the write leaves it empty or
cut, and every later DVC command fails until it is restored from git (issue 9). Every DVC call of the runner
(pipelines/runner) goes through this module, which makes DVC write such files to a temporary sibling and rename it
into place (POSIX ``rename`` is atomic: a reader sees the old file or the new one). The runner also keeps a copy of
the last dvc.lock it saw whole and restores it at start if something else (a plain ``dvc repro`` killed at the
wrong moment) broke the file.

DVC internals used here, each because DVC has no public API for it:
- ``dvc.utils.serialize.*._dump_data`` (replaced, ``patch_dvc``): DVC offers no hook or option for atomic writes.
- ``dvc.stage.run._make_cmd`` and ``dvc.utils.fix_env`` (``shell_probe``): how DVC turns a stage's ``cmd`` into a
  process; the runner must resolve ``python`` exactly as DVC will before anything runs.
- ``Repo.index.stages``, ``stage.save``/``commit``, ``dvcfile.dump_stages`` (``commit``): what ``dvc commit --force``
  does, but collecting the pipeline once for many stages and refusing stages whose params changed.
- ``dvc.schema.COMPILED_LOCKFILE_SCHEMA`` with ``dvc.utils.strictyaml`` (``problem``): DVC's own lock-file check.

    python -m pipelines.runner.lockfile dvc ARGS...        # DVC's command line, with atomic writes
    python -m pipelines.runner.lockfile commit [--ran-with=FILE] STAGE...   # `dvc commit --force STAGE...`, one pass
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import shutil
import signal
import sys
from pathlib import Path

from pipelines.leftovers import temp_sibling
from pipelines.tracking import RUNNER_ENV, flock_holder

LOCK = Path("dvc.lock")
GOOD = Path(".dvc/tmp/runner/dvc.lock.good")  # .dvc/tmp is DVC's own scratch space (git-ignored)
DVC_LOCK = Path(".dvc/tmp/lock")  # DVC's repository lock (zc.lockfile: an flock, the holder's pid inside)
RWLOCK = Path(".dvc/tmp/rwlock")  # DVC's JSON of the stages' read/write locks, rewritten in place by DVC


class BrokenLockError(RuntimeError):
    """dvc.lock cannot be read and there is no good copy to restore (one line, for the user)."""


def _atomic_dump_data(path, data, dumper, fs=None, **dumper_args) -> None:
    """``dvc.utils.serialize._common._dump_data`` (same signature), but through a temporary sibling + rename."""
    if fs is not None and getattr(fs, "protocol", None) != "local":
        return _ORIGINAL_DUMP(path, data, dumper, fs=fs, **dumper_args)
    path = os.fspath(path)
    tmp = os.fspath(temp_sibling(Path(path)))
    try:
        with open(tmp, "w", encoding="utf-8") as fd:
            dumper(data, fd, **dumper_args)
            fd.flush()
            os.fsync(fd.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


_ORIGINAL_DUMP = None


def patch_dvc() -> None:
    """Makes every YAML/JSON/TOML file DVC writes in this process (dvc.lock, dvc.yaml, params) atomic."""
    global _ORIGINAL_DUMP
    from dvc.utils.serialize import _common, _json, _py, _toml, _yaml

    if _ORIGINAL_DUMP is None:
        _ORIGINAL_DUMP = _common._dump_data
    for module in (_common, _json, _py, _toml, _yaml):
        module._dump_data = _atomic_dump_data


def shell_probe(env: dict[str, str], command: str) -> tuple[list[str], dict[str, str]]:
    """(argv, environment) with which DVC would run a stage whose ``cmd`` is ``command``: the user's $SHELL with
    DVC's flags (dvc/stage/run.py ``_make_cmd``) and DVC's environment fix-ups (dvc/utils ``fix_env``)."""
    from dvc.stage.run import _make_cmd
    from dvc.utils import fix_env

    return _make_cmd(env.get("SHELL") or "/bin/sh", command), fix_env(env)


REFUSED = "not recorded: "  # commit's stdout line for a stage whose params or input files changed after it ran


def _lookup(tree, key: str):
    """The value at dotted ``key`` of a params mapping (DVC's addressing of a params entry); a fresh object if
    absent, so that it compares unequal to anything."""
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return object()
        tree = tree[part]
    return tree


def changed_params(stage, ran_with: str | None) -> str | None:
    """The first params key whose value DVC is about to record for ``stage`` (after ``stage.save()``) differs from
    the params.yaml text ``ran_with`` the stage ran with; None if every one matches (a comment, or a value the stage
    does not declare, is no change)."""
    from dvc.dependency.param import ParamsDependency
    from ruamel.yaml import YAML

    if ran_with is None:
        return "params.yaml"
    ran = YAML(typ="safe", pure=True).load(ran_with)
    for dep in stage.deps:
        if isinstance(dep, ParamsDependency):
            for key, value in (dep.hash_info.value or {}).items():
                if _lookup(ran, key) != value:
                    return key
    return None


def changed_input(stage, ran_with: dict | str | None) -> str | None:
    """What ``stage`` ran with (pipelines/runner/worker.py ``ran_with``; a bare string is the params text) that DVC
    would not record as such: the first changed params key (``changed_params``), else the first file dependency
    whose md5 now (after ``stage.save()``) is not the one the stage read, or that changed while it ran; None if
    nothing did."""
    if not isinstance(ran_with, dict):
        ran_with = {"params": ran_with, "files": {}}
    key = changed_params(stage, ran_with.get("params"))
    if key is not None:
        return key
    read = ran_with.get("files") or {}
    for dep in stage.deps:
        path = str(dep.def_path)
        if path in read and (read[path] is None or read[path] != (dep.hash_info.value if dep.hash_info else None)):
            return path
    return None


def refused(log: str) -> list[str]:
    """The stages a commit left unrecorded because their params or input files changed (from its output ``log``)."""
    return [line.removeprefix(REFUSED).split(":")[0] for line in log.splitlines() if line.startswith(REFUSED)]


def commit(names: list[str], ran_with: dict[str, dict | None] | None = None) -> None:
    """Records the finished stages ``names`` in dvc.lock exactly as ``dvc commit --force`` does (per stage:
    ``stage.save()``, ``stage.commit()``; then one ``dump_stages`` per dvc.yaml: dvc/repo/commit.py), but collects
    the pipeline once: the CLI re-parses dvc.yaml and rewrites dvc.lock once per named target (~3 s of CPU each at
    100 cells). It waits for DVC's repository lock (a `dvc repro` beside the runner holds it: its first stage is
    refused, tracking.refuse_beside_runner) instead of failing, and then removes from dvc.lock every stage dvc.yaml
    no longer defines (``prune``).

    ``ran_with``: what each stage ran with (pipelines/runner/worker.py ``ran_with``); a stage whose params as DVC
    records them now, or whose file dependencies, differ from it is not recorded (it stays stale) and named on
    stdout (``REFUSED``): what is recorded is what ran."""
    from dvc.repo import Repo, lock_repo

    logging.getLogger("dvc").setLevel(logging.WARNING)  # the runner prints its own line
    with Repo(_wait_for_lock=True) as repo, lock_repo(repo):
        stages = {s.addressing: s for s in repo.index.stages}
        unknown = [n for n in names if n not in stages]
        if unknown:
            raise KeyError(f"no stage {unknown[0]!r} in dvc.yaml")
        chosen = []
        for stage in (stages[n] for n in names):
            stage.save()
            key = changed_input(stage, ran_with[stage.addressing]) if ran_with is not None else None
            if key is not None:
                print(f"{REFUSED}{stage.addressing}: {key} changed after it started", flush=True)
                continue
            stage.commit(relink=True)
            chosen.append(stage)
        by_file: dict = {}
        for stage in chosen:
            by_file.setdefault(stage.dvcfile.path, (stage.dvcfile, []))[1].append(stage)
        for dvcfile, group in by_file.values():
            dvcfile.dump_stages(group, update_pipeline=False)
        pruned = prune(set(stages))
    if pruned:
        print(f"dvc.lock: removed {len(pruned)} entries of stages dvc.yaml no longer defines, e.g. {pruned[0]}")


def prune(defined: set[str], lock: Path = LOCK) -> list[str]:
    """Removes from ``lock`` the entries of stages not in ``defined`` (dvc.yaml's stages at the current params:
    leftovers of earlier designs or of another profile, whose commit keeps them); returns their names. DVC keeps
    such entries forever; a reader looking a path up in dvc.lock would find the stale one first. Under DVC's
    repository lock (``commit``); written through DVC's own YAML round trip (atomic: ``patch_dvc``)."""
    from dvc.utils.serialize import load_yaml, modify_yaml

    if not lock.exists():
        return []
    gone = [name for name in load_yaml(lock).get("stages") or {} if name not in defined]
    if gone:
        with modify_yaml(lock) as doc:
            for name in gone:
                del doc["stages"][name]
    return gone


def problem(path: Path = LOCK) -> str | None:
    """Why DVC could not read ``path`` as a lock file (None if it can): DVC's own loader and schema."""
    from dvc.schema import COMPILED_LOCKFILE_SCHEMA
    from dvc.utils import strictyaml

    try:
        strictyaml.load(os.fspath(path), COMPILED_LOCKFILE_SCHEMA)
    except Exception as e:  # DVC raises YAMLSyntaxError, YAMLValidationError, EncodingError, OSError
        return "empty" if path.exists() and path.stat().st_size == 0 else type(e).__name__
    return None


def _copy_atomic(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_sibling(dst)
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def repair() -> str | None:
    """At start: if dvc.lock exists but DVC cannot read it, restores the last good copy and returns a one-line note
    (None when nothing was wrong). Raises BrokenLockError when there is no good copy."""
    if not LOCK.exists():
        return None
    why = problem(LOCK)
    if why is None:
        _copy_atomic(LOCK, GOOD)
        return None
    if not GOOD.exists() or problem(GOOD) is not None:
        raise BrokenLockError(
            f"{LOCK} is broken ({why}: a DVC process was killed while writing it) and there is no good copy in "
            f"{GOOD}; restore it with `git checkout {LOCK}`"
        )
    _copy_atomic(GOOD, LOCK)
    return (
        f"{LOCK} was broken ({why}: a DVC process was killed while writing it); restored the last good copy "
        f"({GOOD}); stages recorded after that copy will run again"
    )


def dvc_busy() -> str | None:
    """The pid (as DVC wrote it) of a DVC command working in this repository (holding DVC_LOCK), or None."""
    return flock_holder(DVC_LOCK)


def repair_rwlock() -> str | None:
    """At start, with no DVC command running: removes DVC's rwlock if it is not a JSON mapping (a DVC killed
    while rewriting it in place leaves it empty or cut, and every DVC command then fails); DVC recreates it.
    Returns a one-line note, or None when it was whole."""
    try:
        ok = isinstance(json.loads(RWLOCK.read_text(encoding="utf-8")), dict)
    except FileNotFoundError:
        return None
    except (ValueError, OSError):
        ok = False
    if ok:
        return None
    RWLOCK.unlink()
    return f"{RWLOCK} was cut or corrupt (a DVC command was killed while writing it); removed it, DVC starts a new one"


def _die_with_runner() -> None:
    """Under the grid runner (RUNNER_ENV): when the runner dies, even by SIGKILL, the kernel signals this DVC
    (Linux prctl PR_SET_PDEATHSIG), which kills its whole process group: DVC and the stage command it runs (the
    runner starts DVC as a session leader; DVC runs stage commands in its group)."""
    runner = os.environ.get(RUNNER_ENV)
    if not runner or not sys.platform.startswith("linux") or os.getpgrp() != os.getpid():
        return
    signal.signal(signal.SIGUSR2, lambda *_: os.killpg(0, signal.SIGKILL))
    ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGUSR2))  # PR_SET_PDEATHSIG
    if str(os.getppid()) != runner:  # the runner died before prctl took effect
        os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    """Runs DVC with atomic writes; after a success, dvc.lock (whole: it was replaced whole) is the good copy."""
    patch_dvc()
    if argv[:1] == ["dvc"]:
        from dvc.cli import main as dvc_main

        _die_with_runner()
        rc = dvc_main(argv[1:])
    elif argv[:1] == ["commit"] and argv[1:]:
        ran_with = None
        if argv[1].startswith("--ran-with="):
            ran_with = json.loads(Path(argv[1].split("=", 1)[1]).read_text())
            argv = argv[:1] + argv[2:]
        try:
            commit(argv[1:], ran_with)
            rc = 0
        except Exception as e:  # DVC's errors are worded for users; one line
            print(f"error: recording {len(argv) - 1} stages in {LOCK}: {type(e).__name__}: {e}", file=sys.stderr)
            rc = 1
    else:
        print(__doc__, file=sys.stderr)
        return 2
    if rc == 0 and LOCK.exists():
        _copy_atomic(LOCK, GOOD)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Protocol lock: was the analysis protocol fixed before the results it judges, and what changed afterwards?

From the git history of the repository (first-parent history of HEAD, so a merge counts once, when it lands):

* the commits at which any watched params.yaml value changed (e.g. the ``analysis`` section and the design values it
  judges: KL targets, coefficients), the newest one being the lock;
* for each result stage (the caller names them: the grid cells whose results the protocol judges), the commit from
  which dvc.lock has held its current outputs continuously, i.e. when the results now reported were recorded;
* every protocol change made after the first of those results existed: an amendment, listed in the report.

Git orders commits, not edits within one commit: a protocol change committed together with results cannot be shown
to precede them, and is reported as such. Uncommitted changes to params.yaml or dvc.lock are reported too. Outside a
git repository (or without git) the status says so and nothing fails.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

UNREADABLE = "<unreadable>"


@dataclass(frozen=True)
class Change:
    commit: str
    date: str
    subject: str
    keys: tuple[str, ...]  # the watched keys whose values changed


@dataclass(frozen=True)
class LockStatus:
    """What git says about the protocol and the results. ``results_after_lock``: True when every current result was
    recorded in a commit after the lock commit (or is uncommitted), False when some was recorded before it or in the
    same commit, None when unknown."""

    available: bool
    reason: str = ""
    lock: Change | None = None
    results_first: Change | None = None
    results_last: Change | None = None
    results_uncommitted: int = 0
    results_missing: int = 0
    results_after_lock: bool | None = None
    same_commit: bool = False
    protocol_uncommitted: bool = False
    amendments: tuple[Change, ...] = field(default_factory=tuple)

    def sentences(self) -> list[str]:
        """The report's words for it."""
        if not self.available:
            return [f"Protocol lock not checked: {self.reason}."]
        c = lambda x: f"{x.commit[:10]} ({x.date[:10]}, “{x.subject}”)"
        out = [f"The protocol last changed at commit {c(self.lock)}." if self.lock else "No protocol commit found."]
        if self.protocol_uncommitted:
            out.append("params.yaml has uncommitted changes to the protocol: this report judges an unlocked protocol.")
        if self.results_first is None and not self.results_uncommitted:
            out.append("No results of the judged stages are recorded in dvc.lock.")
        else:
            if self.results_first is None:
                span = "no commit"
            elif self.results_first == self.results_last:
                span = f"commit {c(self.results_first)}"
            else:
                span = f"commits {c(self.results_first)} to {c(self.results_last)}"
            out.append(
                f"The reported results were recorded in {span}"
                + (f"; {self.results_uncommitted} stage(s) are not committed yet" if self.results_uncommitted else "")
                + (f"; {self.results_missing} stage(s) have no dvc.lock entry" if self.results_missing else "")
                + "."
            )
        if self.same_commit:
            out.append("Protocol and results were committed together: git cannot show which came first.")
        elif self.results_after_lock is True:
            out.append("Every result was recorded after the protocol lock.")
        elif self.results_after_lock is False:
            out.append("Some results were recorded BEFORE the protocol lock.")
        if self.amendments:
            out.append(
                "Amendments (protocol changes after results existed): "
                + "; ".join(f"{c(a)} changed {', '.join(a.keys)}" for a in self.amendments)
                + "."
            )
        else:
            out.append("No protocol change was made after results existed (no amendments).")
        return out


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def _history(root: Path, path: str) -> list[Change]:
    """First-parent commits touching ``path``, oldest first."""
    out = _git(root, "log", "--first-parent", "--format=%H%x1f%cI%x1f%s", "--", path)
    rows = [line.split("\x1f") for line in out.splitlines() if line]
    return [Change(h, d, s, ()) for h, d, s in reversed(rows)]


def _load(text: str | None):
    if text is None:
        return None
    try:
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        return UNREADABLE


def _show(root: Path, commit: str, path: str):
    try:
        return _load(_git(root, "show", f"{commit}:./{path}"))
    except subprocess.CalledProcessError:
        return None


def _pick(doc, key: str):
    """The value at a dotted key ("grid.kl_targets") as canonical JSON; None when absent."""
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return json.dumps(doc, sort_keys=True, default=str)


def _outs(lock, stages: Callable[[str], bool]) -> dict[str, str]:
    """stage -> canonical JSON of its recorded outputs, for the selected stages of a dvc.lock document."""
    st = lock.get("stages", {}) if isinstance(lock, dict) else {}
    return {k: json.dumps(v.get("outs"), sort_keys=True) for k, v in st.items() if stages(k) and isinstance(v, dict)}


def protocol_lock(
    root: Path | str,
    watched: Sequence[str],
    result_stages: Callable[[str], bool] | Collection[str],
    params_file: str = "params.yaml",
    lock_file: str = "dvc.lock",
) -> LockStatus:
    """The lock status of the repository at ``root``. ``watched``: dotted params.yaml keys of the protocol (e.g.
    "analysis", "grid.kl_targets", "grid.coefs"); ``result_stages``: the dvc.lock stage names (or a predicate on
    them) whose results the protocol judges."""
    root = Path(root)
    keep = result_stages if callable(result_stages) else set(result_stages).__contains__
    try:
        _git(root, "rev-parse", "--verify", "HEAD")
    except (OSError, subprocess.CalledProcessError) as e:
        return LockStatus(False, "not a git repository with commits" if isinstance(e, subprocess.CalledProcessError)
                          else f"git is not available ({e})")  # fmt: skip
    order = {h: i for i, h in enumerate(reversed(_git(root, "rev-list", "--first-parent", "HEAD").split()))}
    changes, prev = [], None
    for ch in _history(root, params_file):
        snap = {k: _pick(_show(root, ch.commit, params_file), k) for k in watched}
        if prev is None:  # the file's first commit introduces the keys it has
            diff = tuple(k for k in watched if snap[k] is not None)
        else:
            diff = tuple(k for k in watched if snap[k] != prev[k])
        if diff:
            changes.append(Change(ch.commit, ch.date, ch.subject, diff))
        prev = snap
    work = (root / params_file).read_text() if (root / params_file).is_file() else None
    uncommitted = prev is not None and {k: _pick(_load(work), k) for k in watched} != prev
    # when each current result was recorded: the oldest commit from which its outs stayed as they are now
    current = _outs(_load((root / lock_file).read_text()) if (root / lock_file).is_file() else None, keep)
    since: dict[str, Change] = {}
    history = _history(root, lock_file)
    at_head = _outs(_show(root, "HEAD", lock_file), keep) if history else {}
    alive = {k for k, v in current.items() if at_head.get(k) == v}
    for ch in reversed(history):
        outs = _outs(_show(root, ch.commit, lock_file), keep)
        for k in list(alive):
            if outs.get(k) == current[k]:
                since[k] = ch
            else:
                alive.discard(k)
        if not alive:
            break
    rec = sorted(since.values(), key=lambda c: order.get(c.commit, -1))
    lock = changes[-1] if changes else None
    first, last = (rec[0], rec[-1]) if rec else (None, None)
    pos = lambda c: order.get(c.commit, -1)
    after = same = None
    if lock and (rec or len(current) > len(since)):
        same = any(pos(c) == pos(lock) for c in rec)
        after = all(pos(c) > pos(lock) for c in rec)
    amend = tuple(c for c in changes if first and pos(c) > pos(first))
    return LockStatus(
        available=True,
        lock=lock,
        results_first=first,
        results_last=last,
        results_uncommitted=len(current) - len(since),
        results_missing=0 if callable(result_stages) else len(set(result_stages) - set(current)),
        results_after_lock=after,
        same_commit=bool(same),
        protocol_uncommitted=uncommitted,
        amendments=amend,
    )

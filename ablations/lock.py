"""Protocol lock: was the analysis protocol fixed before the results it judges, and what changed afterwards?

From the git history of the repository (first-parent history of HEAD, so a merge counts once, when it lands):

* the commits at which any watched value changed, the newest one being the lock. What is watched is derived from the
  pipeline itself, not hand-picked: :func:`watched_keys` lists every parameter the stages of dvc.yaml declare
  (``params:``), so a change to anything that changes a result is a protocol change; extra files a stage depends on
  (e.g. a protocol JSON) can be watched by content (``watched_files``);
* for each result stage (the caller names them: the grid cells whose results the protocol judges), the commit from
  which dvc.lock has held its current outputs continuously, i.e. when the results now reported were recorded;
* every protocol change made after the first of those results existed: an amendment, listed in the report, together
  with the judged results as they were before it (:func:`earlier_verdicts`), so an amendment never hides what the
  protocol said before it.

Watched entries (the ``watched`` argument of :func:`protocol_lock`, the output of :func:`watched_keys`):

* ``"a.b"``: the dotted key ``a.b`` of params.yaml (``params_file``);
* ``"other.yaml:a.b"``: the dotted key ``a.b`` of another YAML/JSON/TOML file (in a file of another format, the whole
  file is compared);
* ``"other.yaml"`` (a name ending in a parameter file suffix: .yaml, .yml, .json, .toml, .py) or ``"other.yaml:"``:
  the whole file. YAML/JSON/TOML files are compared by parsed value (a comment or formatting change is not a change),
  others by content.

Git orders commits, not edits within one commit: a protocol change committed together with results cannot be shown
to precede them, and is reported as such. Uncommitted changes to the watched files or dvc.lock are reported too.
Outside a git repository (or without git) the status says so and nothing fails.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import subprocess
import tomllib
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

UNREADABLE = "<unreadable>"
PARAMS_FILE = "params.yaml"
PARAM_FILE_SUFFIXES = (".yaml", ".yml", ".json", ".toml", ".py")  # what DVC accepts as a parameter file
_TEMPLATE = re.compile(r"\$\{")


@dataclass(frozen=True)
class Change:
    commit: str
    date: str
    subject: str
    keys: tuple[str, ...]  # the watched keys (or watched file names) whose values changed

    def describe(self) -> str:
        return f"{self.commit[:10]} ({self.date[:10]}, “{self.subject}”)"


class AmendmentRow(NamedTuple):
    """One row of the amendments table: the judged ``question``'s verdict ``before`` the amendment (in the report
    committed just before it; None when that report had no such question or there was none) and ``after`` it (in
    the ``current`` document the caller passed; None when not given or absent there)."""

    commit: str
    date: str
    keys: tuple[str, ...]
    question: str | None
    before: Any
    after: Any


@dataclass(frozen=True)
class LockStatus:
    """What git says about the protocol and the results. ``results_after_lock``: True when every current result was
    recorded in a commit after the lock commit (or is uncommitted), False when some was recorded before it or in the
    same commit, None when unknown. ``before``: for each amendment, in order, the judged report (``report_path`` of
    :func:`protocol_lock`) as committed just before it, None when there was none; empty when ``report_path`` was
    not given. ``uncommitted_keys``: the watched keys/files whose working-tree value differs from HEAD."""

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
    before: tuple[tuple[Change, dict | None], ...] = field(default_factory=tuple)
    uncommitted_keys: tuple[str, ...] = field(default_factory=tuple)
    frozen: Change | None = None  # the protocol's last change at or before the oldest current result (None: none)

    def sentences(self) -> list[str]:
        """The report's words for it."""
        if not self.available:
            return [f"Protocol lock not checked: {self.reason}."]
        c = Change.describe
        if self.amendments and self.frozen:
            out = [f"The protocol was frozen at commit {c(self.frozen)}; it last changed at commit {c(self.lock)}, "
                   "after results existed (amendments below)."]  # fmt: skip
        else:
            out = [f"The protocol last changed at commit {c(self.lock)}." if self.lock else "No protocol commit found."]
        if self.protocol_uncommitted:
            which = f" ({', '.join(self.uncommitted_keys)})" if self.uncommitted_keys else ""
            out.append(f"The protocol has uncommitted changes{which}: this report judges an unlocked protocol.")
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
        elif self.amendments and self.frozen:  # not the same commit: frozen precedes the oldest result
            out.append("Every result was recorded after the frozen protocol; the amendments came after results.")
        elif self.results_after_lock is False:
            out.append("Some results were recorded BEFORE the protocol lock.")
        if self.amendments:
            out.append(
                "Amendments (protocol changes after results existed): "
                + "; ".join(f"{c(a)} changed {', '.join(a.keys)}" for a in self.amendments)
                + "."
            )
        elif self.results_first is not None:  # a claim about the history only when committed results exist
            if self.protocol_uncommitted:
                out.append("No committed protocol change was made after results existed (no amendments yet).")
            else:
                out.append("No protocol change was made after results existed (no amendments).")
        return out

    def amendment_rows(
        self, extract: Callable[[dict], Mapping[str, Any]], current: dict | None = None
    ) -> list[AmendmentRow]:
        """One row per (amendment, question): ``extract`` maps a judged report (e.g. stats.json) to {question:
        verdict}, ``current`` is the report now (its verdicts fill ``after``; without it ``after`` is None for the
        caller to fill). Questions are those of the earlier report, then any new ones of ``current``; an amendment
        with no earlier report and no ``current`` still gets one row (question None). Needs ``before``, i.e.
        :func:`protocol_lock` called with ``report_path``; raises ValueError otherwise."""
        if self.amendments and len(self.before) != len(self.amendments):
            raise ValueError("amendment_rows needs the earlier reports: call protocol_lock with report_path")
        now = dict(extract(current)) if current is not None else {}
        rows = []
        for change, doc in self.before:
            then = dict(extract(doc)) if doc is not None else {}
            questions = list(then) + [q for q in now if q not in then]
            for q in questions or [None]:
                rows.append(AmendmentRow(change.commit, change.date, change.keys, q, then.get(q), now.get(q)))
        return rows


# --- what is watched: the parameters the stages of dvc.yaml declare -------------------------------------------------


def _fixed_prefix(key: str) -> str:
    """The key cut back to its last fixed dotted prefix: ``grid.arms.${item.arm}`` -> ``grid.arms``,
    ``a.b_${x}.c`` -> ``a``, ``${x}`` -> ``""`` (the whole file)."""
    m = _TEMPLATE.search(key)
    if m is None:
        return key
    return key[: m.start()].rpartition(".")[0]


def _entry(file: str, key: str | None, params_file: str) -> str:
    """A watched entry in the notation of the module docstring."""
    if not key:
        return file
    return key if file == params_file else f"{file}:{key}"


def _covers(a: str, b: str, params_file: str) -> bool:
    """Whether watching ``a`` already watches ``b`` (``grid`` covers ``grid.arms``, ``x.yaml`` covers ``x.yaml:k``,
    the whole params file covers its keys)."""
    fa, ka = _spec(a, params_file)
    fb, kb = _spec(b, params_file)
    if fa != fb or ka == kb:
        return False
    return ka is None or (kb is not None and kb.startswith(ka + "."))


def watched_keys(
    dvc_yaml: Path | str, stage_prefixes: Sequence[str] | None = None, params_file: str = PARAMS_FILE
) -> list[str]:
    """Every parameter the stages of ``dvc_yaml`` declare in ``params:`` (optionally only the stages whose name
    starts with one of ``stage_prefixes``, e.g. ``["grammar_"]``), as watched entries for :func:`protocol_lock`:
    a string is a key of params.yaml; ``{params.yaml: [a, b]}`` gives ``a`` and ``b``; ``{other.yaml: [k]}`` gives
    ``other.yaml:k``; ``{other.yaml: null}`` (no keys) the file ``other.yaml``. Templated parts (``${...}``) are cut
    back to the last fixed dotted prefix (``grid.arms.${item.arm}`` -> ``grid.arms``; a key that starts templated
    watches its whole file). Deduplicated, sorted, and without any entry another one covers (``grid`` covers
    ``grid.arms``)."""
    if isinstance(stage_prefixes, str):
        stage_prefixes = [stage_prefixes]
    doc = _yaml(Path(dvc_yaml).read_text()) or {}
    stages = doc.get("stages") or {}
    if not isinstance(stages, dict):
        raise ValueError(f"{dvc_yaml}: 'stages' is not a mapping")
    found: set[str] = set()
    for name, stage in stages.items():
        if stage_prefixes is not None and not any(str(name).startswith(p) for p in stage_prefixes):
            continue
        if isinstance(stage, dict) and isinstance(stage.get("do"), dict):  # foreach/do form
            stage = stage["do"]
        items = stage.get("params") if isinstance(stage, dict) else None
        for item in items or []:
            if isinstance(item, str):
                found.add(_entry(params_file, _fixed_prefix(item), params_file))
            elif isinstance(item, dict):
                for file, keys in item.items():
                    if keys is None or keys == []:
                        found.add(_entry(str(file), None, params_file))
                        continue
                    for key in [keys] if isinstance(keys, str) else keys:
                        found.add(_entry(str(file), _fixed_prefix(str(key)), params_file))
            else:
                raise ValueError(f"{dvc_yaml}: stage {name}: unreadable params entry {item!r}")
    return sorted(k for k in found if not any(_covers(o, k, params_file) for o in found))


# --- git ---------------------------------------------------------------------------------------------------------


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True, check=True).stdout


def _git_problem(root: Path) -> str | None:
    """Why the protocol lock cannot be read from git here; None when it can."""
    try:
        _git(root, "rev-parse", "--verify", "HEAD")
    except subprocess.CalledProcessError:
        return "not a git repository with commits"
    except OSError as e:
        return f"git is not available ({e})"
    return None


def _position(order: dict[str, int], c: Change) -> int:
    """A commit's place on the first-parent line (-1: not on it)."""
    return order.get(c.commit, -1)


def _history(root: Path, *paths: str) -> list[Change]:
    """First-parent commits touching any of ``paths``, oldest first."""
    out = _git(root, "log", "--first-parent", "--format=%H%x1f%cI%x1f%s", "--", *paths)
    rows = [line.split("\x1f") for line in out.splitlines() if line]
    return [Change(h, d, s, ()) for h, d, s in reversed(rows)]


def _yaml(text: str):
    """YAML 1.2 as DVC and the params check read it (ruamel.yaml's safe loader): ``1e-8`` is a float, where PyYAML's
    YAML 1.1 reads a string, so a committed params.yaml means here what it meant to the runs."""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load(text)


def _load(text: str | None):
    from ruamel.yaml.error import YAMLError

    if text is None:
        return None
    try:
        return _yaml(text)
    except (YAMLError, RecursionError):
        return UNREADABLE


def _lock(raw: bytes | str | None):
    """A dvc.lock document, read with libyaml (PyYAML's C safe loader; its pure loader where libyaml is missing).
    The walk below reads one lock per commit back to the oldest current result, and ruamel's pure loader (``_load``)
    takes about 25 s on a 5 MB lock here against about 3.5 s. The outs read the same either way: DVC writes (YAML
    1.2) quoted whatever 1.2 would read as a number, and the 1.1-only forms (``12:30``, ``yes``) cannot be a hex hash
    or an out path of this pipeline (each starts with its folder); only their equality between commits is used.
    ``_load`` stays the reader of params and protocol files, whose values count."""
    import yaml

    if raw is None:
        return None
    try:
        return yaml.load(raw, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except (yaml.YAMLError, RecursionError):
        return UNREADABLE


def _show_bytes(root: Path, commit: str, path: str) -> bytes | None:
    r = subprocess.run(["git", "-C", str(root), "show", f"{commit}:./{path}"], capture_output=True)
    return r.stdout if r.returncode == 0 else None


def _pick(doc, key: str):
    """The value at a dotted key ("grid.kl_targets") as canonical JSON; None when absent."""
    for part in key.split("."):
        if not isinstance(doc, dict) or part not in doc:
            return None
        doc = doc[part]
    return json.dumps(doc, sort_keys=True, default=str)


def _spec(entry: str, params_file: str = PARAMS_FILE) -> tuple[str, str | None]:
    """(file, dotted key or None for the whole file) of a watched entry."""
    if ":" in entry:
        file, _, key = entry.partition(":")
        return file, key or None
    if entry.endswith(PARAM_FILE_SUFFIXES):
        return entry, None
    return params_file, entry


def _parse(file: str, raw: bytes | None):
    """A file's content as a value to compare: parsed for YAML/JSON/TOML, else its hash; None when absent."""
    if raw is None:
        return None
    text = raw.decode("utf-8", "replace")
    try:
        if file.endswith((".yaml", ".yml")):
            return _load(text)
        if file.endswith(".json"):
            return json.loads(text)
        if file.endswith(".toml"):
            return tomllib.loads(text)
    except (ValueError, tomllib.TOMLDecodeError):
        return UNREADABLE
    return _Opaque(hashlib.sha256(raw).hexdigest())


class _Opaque(str):
    """The content hash of a file whose keys cannot be read (a key in it watches the whole file)."""


def _value(doc, key: str | None):
    """The watched value: the whole (parsed) file when ``key`` is None or the file is opaque, else the key's."""
    if key is None or isinstance(doc, _Opaque):
        return None if doc is None else json.dumps(doc, sort_keys=True, default=str)
    return _pick(doc, key)


def _outs(lock, stages: Callable[[str], bool]) -> dict[str, str]:
    """stage -> canonical JSON of its recorded outputs, for the selected stages of a dvc.lock document."""
    st = lock.get("stages", {}) if isinstance(lock, dict) else {}
    return {k: json.dumps(v.get("outs"), sort_keys=True) for k, v in st.items() if stages(k) and isinstance(v, dict)}


def earlier_verdicts(root: Path | str, amendment: Change, path: str) -> dict | None:
    """The JSON document at ``path`` (e.g. "reports/grammar/stats.json", relative to ``root``) as committed at the
    amendment commit's first parent, i.e. the judged results as they stood just before the protocol changed; None
    when it was absent there (or not a JSON object, or the commit has no parent)."""
    raw = _show_bytes(Path(root), f"{amendment.commit}^", path)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def protocol_lock(
    root: Path | str,
    watched: Sequence[str],
    result_stages: Callable[[str], bool] | Collection[str],
    params_file: str = PARAMS_FILE,
    lock_file: str = "dvc.lock",
    watched_files: Sequence[str] = (),
    report_path: str | None = None,
) -> LockStatus:
    """The lock status of the repository at ``root``. ``watched``: the protocol's entries (module docstring; usually
    :func:`watched_keys` of dvc.yaml, e.g. "analysis", "grid", "other.yaml:k"); ``watched_files``: further files
    (e.g. a stage's protocol dependency "protocol/grammar.json") compared by content, a change reported under the
    file's name; ``result_stages``: the dvc.lock stage names (or a predicate on them) whose results the protocol
    judges; ``report_path``: the judged report (e.g. "reports/grammar/stats.json") to keep, for each amendment, as
    it was before it (``LockStatus.before``)."""
    root = Path(root)
    keep = result_stages if callable(result_stages) else set(result_stages).__contains__
    problem = _git_problem(root)
    if problem:
        return LockStatus(False, problem)
    order = {h: i for i, h in enumerate(reversed(_git(root, "rev-list", "--first-parent", "HEAD").split()))}
    pairs: dict[tuple[str, str | None], str] = {}  # (file, key or None) -> the name a change is reported under
    for name in watched:
        pairs.setdefault(_spec(name, params_file), name)
    for f in watched_files:
        pairs.setdefault((f, None), f)
    specs, shown = list(pairs), list(pairs.values())
    files = list(dict.fromkeys(f for f, _ in specs))
    touched = {f: {c.commit for c in _history(root, f)} for f in files}
    docs: dict[str, Any] = {f: None for f in files}
    changes: list[Change] = []
    prev = [None] * len(specs)  # a file's first commit introduces the keys it has
    for ch in _history(root, *files) if files else []:
        for f in files:
            if ch.commit in touched[f]:
                docs[f] = _parse(f, _show_bytes(root, ch.commit, f))
        snap = [_value(docs[f], k) for f, k in specs]
        diff = tuple(shown[i] for i in range(len(specs)) if snap[i] != prev[i])
        if diff:
            changes.append(Change(ch.commit, ch.date, ch.subject, diff))
        prev = snap
    work = {f: _parse(f, (root / f).read_bytes() if (root / f).is_file() else None) for f in files}
    dirty = tuple(shown[i] for i, (f, k) in enumerate(specs) if _value(work[f], k) != prev[i])
    # when each current result was recorded: the oldest commit from which its outs stayed as they are now
    current = _outs(_lock((root / lock_file).read_bytes()) if (root / lock_file).is_file() else None, keep)
    since: dict[str, Change] = {}
    history = _history(root, lock_file)
    at_head = _outs(_lock(_show_bytes(root, "HEAD", lock_file)), keep) if history else {}
    alive = {k for k, v in current.items() if at_head.get(k) == v}
    for ch in reversed(history):
        outs = _outs(_lock(_show_bytes(root, ch.commit, lock_file)), keep)
        for k in list(alive):
            if outs.get(k) == current[k]:
                since[k] = ch
            else:
                alive.discard(k)
        if not alive:
            break
    pos = functools.partial(_position, order)
    rec = sorted(since.values(), key=pos)
    lock = changes[-1] if changes else None
    first, last = (rec[0], rec[-1]) if rec else (None, None)
    after = same = None
    if lock and (rec or len(current) > len(since)):
        same = any(pos(c) == pos(lock) for c in rec)
        after = all(pos(c) > pos(lock) for c in rec)
    amend = tuple(c for c in changes if first and pos(c) > pos(first))
    frozen = next((c for c in reversed(changes) if first and pos(c) <= pos(first)), None)
    before = tuple((a, earlier_verdicts(root, a, report_path)) for a in amend) if report_path else ()
    return LockStatus(
        available=True,
        lock=lock,
        results_first=first,
        results_last=last,
        results_uncommitted=len(current) - len(since),
        results_missing=0 if callable(result_stages) else len(set(result_stages) - set(current)),
        results_after_lock=after,
        same_commit=bool(same),
        protocol_uncommitted=bool(dirty),
        amendments=amend,
        before=before,
        uncommitted_keys=dirty,
        frozen=frozen,
    )

"""Apply a run profile to params.yaml: `python -m pipelines.profile NAME` (`make repro PROFILE=NAME` runs it first).

A profile is ``profiles/NAME.yaml``, a partial params.yaml. Its values are merged into params.yaml: a mapping
merges key by key (a profile can add arms, or change one PPO value), anything else (a number, a list) replaces the
value. The merged parameters are validated exactly as params.yaml is (one line naming the key and the allowed
values, and nothing written, if one is wrong); then params.yaml is rewritten in place, in its own layout (comments
kept, one-line lists and arms stay on one line). `git diff params.yaml` shows what the profile changed.

Back to the default: `python -m pipelines.profile --reset` (`make reset`) restores params.yaml and what a profile's
run rewrites (dvc.lock, reports/, protocol/, metrics/: RESET_PATHS) from the last commit, then `dvc checkout` puts
the outputs dvc.lock records back in the workspace (from the DVC cache; `dvc pull` first on a fresh clone).
`git checkout params.yaml` alone is not enough: the profile's analysis has rewritten the tracked reports.

A profile may not touch ``analysis``: the pre-registered protocol (margins, alpha, tolerances) is the same for every
profile, and a changed protocol is an amendment made in params.yaml itself, where the report's protocol lock sees it.
DVC sees an ordinary parameter change: the stages whose parameters changed rerun, the others stay cached.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq

from ablations.config import PARAMS_FILE, ParamsError, load_params, read_yaml
from pipelines.leftovers import temp_sibling

PROFILES = Path("profiles")
RESET_PATHS = ("params.yaml", "dvc.lock", "reports", "protocol", "metrics")  # what a run rewrites that git tracks


def merge(base, over, where: str = "") -> list[str]:
    """Merges mapping ``over`` into ruamel mapping ``base`` in place; returns the dotted keys whose value changed."""
    changed = []
    for key, value in over.items():
        path = f"{where}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            changed += merge(base[key], value, f"{path}.")
        elif base.get(key) != value:
            put(base, key, value)
            changed.append(path)
    return changed


def put(mapping, key, value) -> None:
    """``mapping[key] = value`` in params.yaml's layout: a list replaces the items of the list there (keeping its
    one-line [flow] style and its comment), a new list or a mapping of plain values is written on one line as
    params.yaml writes them (``instances: [100, 101]``, an arm ``{target: reference, ...}``)."""
    old = mapping.get(key)
    plain = isinstance(value, list) and not any(isinstance(v, dict | list) for v in value)
    if isinstance(old, CommentedSeq) and isinstance(value, list):
        old[:] = value
        if plain and (old.fa.flow_style() or not value or len(old) == len(value)):
            old.fa.set_flow_style()  # ruamel loads `[]` without a style: it would write the new items one per line
        return
    mapping[key] = styled(value)


def styled(value):
    """``value`` as params.yaml lays out what it holds: a list of plain values or a mapping of plain values on one
    line (``[20, 40]``, ``{target: reference, ...}``), a mapping holding lists or mappings one key per line."""
    if isinstance(value, list):
        out = CommentedSeq(styled(v) for v in value)
        if not any(isinstance(v, dict | list) for v in value):
            out.fa.set_flow_style()
        return out
    if isinstance(value, dict):
        out = CommentedMap((k, styled(v)) for k, v in value.items())
        if not any(isinstance(v, dict | list) for v in value.values()):
            out.fa.set_flow_style()
        return out
    return value


def align_comments(node, before) -> None:
    """Brings the comment after a one-line list back next to it when the list got shorter (a profile's 4 instances
    where params.yaml lists 24): ruamel keeps the column of the longest list the line held (column 131). The comment
    moves to where its continuation lines start (params.yaml's instance lists), or two spaces after the list; one
    space if the list is longer than that. Only lists that differ from ``before`` (the document as loaded) move."""
    if isinstance(node, dict):
        was = before if isinstance(before, dict) else {}
        for key, value in node.items():
            token = node.ca.items.get(key, [None] * 4)[2] if hasattr(node, "ca") else None
            changed = isinstance(value, CommentedSeq) and value.fa.flow_style() and list(value) != was.get(key)
            if changed and token is not None and key in node.lc.data:
                end = node.lc.key(key)[1] + len(str(key)) + 2 + len(", ".join(map(str, value))) + 2  # line length
                if token.column > end + 2:
                    below = [line for line in token.value.split("\n")[1:] if line.strip()]
                    token.column = min((len(line) - len(line.lstrip(" ")) for line in below), default=end + 2)
            align_comments(value, was.get(key))


def apply(name: str, params: Path = PARAMS_FILE, profiles: Path = PROFILES) -> list[str]:
    """Merges profiles/NAME.yaml into ``params`` (validated first; nothing written on error). Returns changed keys."""
    path = profiles / f"{name}.yaml"
    known = ", ".join(sorted(p.stem for p in profiles.glob("*.yaml"))) or "none"
    if path.resolve().parent != profiles.resolve():  # ../x, /etc/x or a link out: only the repository's profiles
        raise ParamsError(
            f"PROFILE {name!r}: not a file in {profiles}/ (it resolves to {path.resolve()}); profiles: {known}"
        )
    if not path.is_file():
        raise ParamsError(f"no profile {name!r} ({path} does not exist); profiles: {known}")
    read_yaml(params)  # params.yaml itself readable (UTF-8, plain YAML 1.2) before anything is merged into it
    over = read_yaml(path)
    if not isinstance(over, dict):
        raise ParamsError(f"{path}: must be a mapping of params.yaml sections")
    if "analysis" in over:
        raise ParamsError(f"{path}: a profile may not change 'analysis' (the protocol is the same for every profile)")
    changed = edit(params, lambda doc: merge(doc, over), f"{params} with profile {name}")
    return changed


def edit(params: Path, change, what: str):
    """Applies ``change(doc)`` to params.yaml as a round-trip document (comments and layout kept), validates the
    result exactly as params.yaml is (ParamsError naming ``what``; nothing written), then replaces the file whole.
    Returns what ``change`` returned."""
    rt = YAML()  # round trip: keeps params.yaml's comments and layout
    rt.width = 4096
    rt.indent(mapping=2, sequence=4, offset=2)  # params.yaml's block lists (grid.design); ruamel's default: 2, 0
    rt.representer.add_representer(type(None), lambda r, _: r.represent_scalar("tag:yaml.org,2002:null", "null"))
    text = params.read_text()
    doc = rt.load(text)
    out = change(doc)
    align_comments(doc, YAML(typ="safe").load(text))
    buf = io.StringIO()
    rt.dump(doc, buf)
    tmp = temp_sibling(params)  # a killed edit's leftover: pipelines.leftovers.clean_temp removes it
    try:
        tmp.write_text(buf.getvalue())
        try:
            load_params(tmp)  # the same checks and one-line messages as params.yaml itself
        except ParamsError as e:
            raise ParamsError(str(e).replace(str(tmp), what)) from None
        os.replace(tmp, params)  # whole or not at all
    finally:
        tmp.unlink(missing_ok=True)
    return out


def reset(paths=RESET_PATHS) -> None:
    """The default state: ``paths`` as the last commit has them (files git tracks; new untracked files are left),
    then `dvc checkout` of the outputs dvc.lock records (a note if the DVC cache lacks some)."""
    git = ["git", "ls-tree", "-r", "--name-only", "HEAD", "--", *paths]
    tracked = subprocess.run(git, capture_output=True, text=True, check=True).stdout.split()
    held = [p for p in paths if any(f == p or f.startswith(f"{p}/") for f in tracked)]
    if held:
        subprocess.run(["git", "checkout", "HEAD", "--", *held], check=True)
    out = subprocess.run([sys.executable, "-m", "dvc", "checkout", "--quiet"], capture_output=True, text=True)
    if out.returncode:
        last = (out.stderr.strip().splitlines() or ["?"])[-1]
        print(f"note: `dvc checkout` could not restore every output ({last}); `dvc pull` fetches them from a remote")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--reset"]:
        reset()
        print(f"{', '.join(RESET_PATHS)} restored from the last commit; `dvc status` shows what still differs")
        return 0
    if len(argv) != 1 or argv[0].startswith("-"):
        print("usage: python -m pipelines.profile NAME | --reset  (NAME: a file profiles/NAME.yaml)", file=sys.stderr)
        return 2
    try:
        changed = apply(argv[0])
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = ", ".join(changed) if changed else "nothing (already applied)"
    print(f"profile {argv[0]} applied to {PARAMS_FILE}: {what}; `make reset` returns to the default")
    return 0


if __name__ == "__main__":
    sys.exit(main())

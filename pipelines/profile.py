"""Apply a run profile to params.yaml: `python -m pipelines.profile NAME` (`make repro PROFILE=NAME` runs it first).

A profile is ``profiles/NAME.yaml``, a partial params.yaml. Its values are merged into params.yaml: a mapping
merges key by key (a profile can add arms, or change one PPO value), anything else (a number, a list) replaces the
value. The merged parameters are validated exactly as params.yaml is (one line naming the key and the allowed
values, and nothing written, if one is wrong); then params.yaml is rewritten in place with its comments kept.
`git diff params.yaml` shows what the profile changed; `git checkout params.yaml` returns to the default.

A profile may not touch ``analysis``: the pre-registered protocol (margins, alpha, tolerances) is the same for every
profile, and a changed protocol is an amendment made in params.yaml itself, where the report's protocol lock sees it.
DVC sees an ordinary parameter change: the stages whose parameters changed rerun, the others stay cached.
"""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path

from ruamel.yaml import YAML

from ablations.config import PARAMS_FILE, ParamsError, load_params, read_yaml
from pipelines.leftovers import temp_sibling

PROFILES = Path("profiles")


def merge(base, over, where: str = "") -> list[str]:
    """Merges mapping ``over`` into ruamel mapping ``base`` in place; returns the dotted keys whose value changed."""
    changed = []
    for key, value in over.items():
        path = f"{where}{key}"
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            changed += merge(base[key], value, f"{path}.")
        elif base.get(key) != value:
            base[key] = value
            changed.append(path)
    return changed


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
    doc = rt.load(params.read_text())
    out = change(doc)
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


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m pipelines.profile NAME  (a file profiles/NAME.yaml)", file=sys.stderr)
        return 2
    try:
        changed = apply(argv[0])
    except ParamsError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = ", ".join(changed) if changed else "nothing (already applied)"
    print(f"profile {argv[0]} applied to {PARAMS_FILE}: {what}; `git checkout {PARAMS_FILE}` returns to the default")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Imports point one way: rlhf (library) <- ablations (design, statistics) <- pipelines (stages, runner).

Every import statement of every module (function-level ones included) is checked, so a cycle or a back-edge fails
here before it confuses a reader or a DVC dependency list."""

from __future__ import annotations

import pytest

from tests.helpers import REPO, imported_modules

LAYER = {"rlhf": 0, "ablations": 1, "pipelines": 2}


def modules():
    for package in LAYER:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            yield name, path


@pytest.mark.parametrize("name, path", list(modules()), ids=lambda x: x if isinstance(x, str) else "")
def test_imports_point_down_the_layers(name, path):
    own = LAYER[name.split(".")[0]]
    wrong = sorted(m for m in imported_modules(path, name) if m.split(".")[0] in LAYER and LAYER[m.split(".")[0]] > own)
    assert not wrong, f"{name} (layer {own}) imports {', '.join(wrong)} from a layer above it"

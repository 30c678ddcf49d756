"""The grid runner on a local Ray cluster (the `ray` extra): same cells, same DVC state as the process pool.

Slow; skipped when Ray is not installed (`pip install -c requirements.lock -e '.[ray]'`).
"""

from __future__ import annotations

import json
import sys

import pytest

from tests.pipelines.tiny import sh

pytestmark = pytest.mark.slow
pytest.importorskip("ray")


def test_ray_runner_leaves_dvc_clean(repo):
    out = sh(repo, sys.executable, "-m", "pipelines.run", "--ray-address", "local")
    assert "7 of 7 calibration cells to run on Ray at local" in out.stdout, out.stdout
    assert "18 of 18 grid cells to run on Ray at local" in out.stdout, out.stdout
    assert json.loads(sh(repo, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}") == {}
    assert (repo / "reports/grammar/report.md").exists()

"""Fixtures of the pipeline tests."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.conftest import repo_params
from tests.pipelines.tiny import TINY, make_repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return make_repo(tmp_path_factory.mktemp("e2e"), repo_params(TINY))


@pytest.fixture
def workdir(tmp_path, monkeypatch) -> Path:
    """A directory that looks like the repository to the runner: params.yaml (the tiny grid) and .dvc/."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(repo_params(TINY), sort_keys=False))
    (tmp_path / ".dvc").mkdir()
    (tmp_path / "fake").mkdir()
    monkeypatch.chdir(tmp_path)
    return tmp_path

"""Fixtures of the pipeline tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import repo_params
from tests.pipelines.tiny import TINY, make_repo


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return make_repo(tmp_path_factory.mktemp("e2e"), repo_params(TINY))

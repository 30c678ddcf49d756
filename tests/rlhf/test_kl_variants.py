"""Expected gradients of every KL estimator, weighting and placement by exact enumeration over small categorical
policies, against the analytic gradient (autograd of the exact KL). float64 throughout."""

import itertools

import pytest
import torch

from rlhf import kl as K
from rlhf.algorithms import ALGORITHMS, AdvantageParams
from rlhf.config import KLConfig
from rlhf.diagnostics import sequence_kl_surrogate
from rlhf.task import EOS, response_mask

D = torch.float64


def kc(**kw) -> KLConfig:
    return KLConfig(**{"target": "reference", "placement": "loss", "estimator": "k1", "coef": 1.0, **kw})


# --- one position: a categorical policy over V tokens --------------------------------------------------------------

V = 5


@pytest.fixture(scope="module")
def bandit():
    g = torch.Generator().manual_seed(0)
    theta = torch.randn(V, generator=g, dtype=D)
    ref = torch.randn(V, generator=g, dtype=D)
    old = theta + 0.7 * torch.randn(V, generator=g, dtype=D)  # pi_old != pi_theta
    return theta, ref, old


def exact_kl_grads(theta, ref):
    """grad_theta KL(pi_theta || pi_ref) and grad_theta KL(pi_ref || pi_theta), analytic through autograd."""
    t = theta.clone().requires_grad_()
    logp, logq = torch.log_softmax(t, -1), torch.log_softmax(ref, -1)
    reverse = (logp.exp() * (logp - logq)).sum()
    forward = (logq.exp() * (logq - logp)).sum()
    return torch.autograd.grad(reverse, t, retain_graph=True)[0], torch.autograd.grad(forward, t)[0]


def expected_loss_grad(config, theta, ref, sampling):
    """sum_y pi_sampling(y) grad k_loss(y): the exact expectation of the loss-side per-sample gradient."""
    t = theta.clone().requires_grad_()
    y = torch.arange(V)
    logprobs = torch.log_softmax(t, -1)[y][:, None]  # (V, 1): every token as a one-token response
    ref_lp = torch.log_softmax(ref, -1)[y][:, None]
    old_lp = torch.log_softmax(sampling, -1)[y][:, None]
    logits = t.expand(V, V)[:, None, :]  # (V, 1, V)
    ref_logits = ref.expand(V, V)[:, None, :]
    mask = torch.ones(V, 1, dtype=D)
    terms = K.loss_kl_terms(config, logprobs, old_lp, ref_lp, logits, ref_logits, mask)  # (V, 1)
    weights = torch.softmax(sampling, -1)
    return torch.autograd.grad((weights * terms[:, 0]).sum(), t)[0]


def expected_reward_grad(config, theta, ref):
    """sum_y pi_theta(y) k(y) grad log pi_theta(y): the REINFORCE gradient of the reward-side KL, on-policy."""
    t = theta.clone().requires_grad_()
    logprobs = torch.log_softmax(t, -1)[:, None]
    ref_lp = torch.log_softmax(ref, -1)[:, None]
    mask = torch.ones(V, 1, dtype=D)
    k = K.reward_kl(
        config, logprobs.detach(), ref_lp, t.detach().expand(V, V)[:, None], ref.expand(V, V)[:, None], mask
    )
    weights = torch.softmax(theta, -1)
    return torch.autograd.grad((weights * logprobs[:, 0] * k[:, 0]).sum(), t)[0]


@pytest.mark.parametrize(
    "estimator, expected",
    [("k1", "zero"), ("k2", "reverse"), ("k3", "forward"), ("full", "reverse"), ("k1+", "reverse"), ("k3+", "reverse")],
)
def test_on_policy_loss_gradients(bandit, estimator, expected):
    theta, ref, _ = bandit
    reverse, forward = exact_kl_grads(theta, ref)
    want = {"zero": torch.zeros(V, dtype=D), "reverse": reverse, "forward": forward}[expected]
    got = expected_loss_grad(kc(estimator=estimator), theta, ref, theta)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    assert reverse.norm() > 0.1 and (reverse - forward).norm() > 0.05  # the cases are distinguishable


@pytest.mark.parametrize("estimator", ["k1", "k3", "k3+", "k1+", "k2"])
def test_importance_weighted_loss_kl_is_the_reverse_kl_gradient_off_policy(bandit, estimator):
    """E_{pi_old}[grad (w k)] = grad KL(pi_theta || pi_ref) at pi_old != pi_theta (DeepSeek-V3.2's estimate):
    for k1 and k3 with a differentiable w (w (k + dk/dlog pi) s = w delta s, plus for k1 a zero-mean w s); for
    k2, k1+, k3+ with the detached ratio (RPG): sg(w) delta s. Before issue 18 the weight was differentiable for
    all five: k1+ x w gave exactly twice the gradient off-policy, k2 x w and k3+ x w were biased."""
    theta, ref, old = bandit
    reverse, _ = exact_kl_grads(theta, ref)
    got = expected_loss_grad(kc(estimator=estimator, is_weight=True), theta, ref, old)
    torch.testing.assert_close(got, reverse, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("estimator", ["k2", "k3"])
def test_unweighted_loss_kl_is_biased_off_policy(bandit, estimator):
    """Guards the test above: without the weight, samples of pi_old give a different gradient."""
    theta, ref, old = bandit
    reverse, forward = exact_kl_grads(theta, ref)
    on_policy = {"k2": reverse, "k3": forward}[estimator]
    got = expected_loss_grad(kc(estimator=estimator), theta, ref, old)
    assert (got - on_policy).norm() > 1e-2


def test_straight_through_values_are_k1_and_k3_values():
    lp, tgt = torch.tensor([[0.3, -1.2, 0.0]], dtype=D), torch.tensor([[-0.4, 0.5, 0.0]], dtype=D)
    for n in ("k1", "k3"):
        assert torch.equal(K.kl_per_token(n + "+", lp, tgt), K.kl_per_token(n, lp, tgt))
    x = lp.clone().requires_grad_()
    (K.kl_per_token("k3+", x, tgt).sum()).backward()
    torch.testing.assert_close(x.grad, lp - tgt)  # the gradient of k2 = delta^2 / 2


@pytest.mark.parametrize("estimator, exact", [("k1", True), ("k3", True), ("k2", False)])
def test_both_placements_same_estimator(bandit, estimator, exact):
    """E[(k + dk/dlog pi) s]: reward side k s (REINFORCE) plus loss side; the reverse-KL gradient for k1 and k3,
    not for k2 (Shah et al. 2025)."""
    theta, ref, _ = bandit
    reverse, _ = exact_kl_grads(theta, ref)
    config = kc(estimator=estimator, placement="both")
    got = expected_reward_grad(config, theta, ref) + expected_loss_grad(config, theta, ref, theta)
    if exact:
        torch.testing.assert_close(got, reverse, atol=1e-12, rtol=1e-10)
    else:
        assert (got - reverse).norm() > 1e-2


def test_reward_k1_is_the_reverse_kl_gradient(bandit):
    theta, ref, _ = bandit
    reverse, _ = exact_kl_grads(theta, ref)
    torch.testing.assert_close(expected_reward_grad(kc(placement="reward"), theta, ref), reverse, atol=1e-12, rtol=0)


def test_both_puts_the_coefficient_in_each_place():
    assert K.placement_coefs(kc(placement="both"), 0.4) == (0.4, 0.4)
    assert K.placement_coefs(kc(placement="reward"), 0.4) == (0.4, None)
    assert K.placement_coefs(kc(placement="loss"), 0.4) == (None, 0.4)
    assert K.placement_coefs(kc(placement="none", estimator=None), 0.4) == (None, None)


# --- sequences: an autoregressive tabular policy, every response enumerated ----------------------------------------

T, W = 3, 3  # response length, vocabulary (token EOS = 1 is among them: lengths 1..T)


def canonical_responses() -> torch.Tensor:
    """Every response the sampler can produce: after the first EOS only EOS (padding). (N, T)."""
    rows = [y for y in itertools.product(range(W), repeat=T) if all(y[i] == EOS for i in range(T) if EOS in y[:i])]
    return torch.tensor(rows)


@pytest.fixture(scope="module")
def chain():
    g = torch.Generator().manual_seed(1)
    theta = torch.randn(T, W + 1, W, generator=g, dtype=D)  # logits[t, previous token (W = start), next token]
    ref = theta + 0.8 * torch.randn(T, W + 1, W, generator=g, dtype=D)
    return theta, ref, canonical_responses()


def table_logits(table, responses):
    prev = torch.cat([torch.full((len(responses), 1), W), responses[:, :-1]], dim=1)  # (N, T)
    return table[torch.arange(T)[None, :], prev]  # (N, T, W)


def sequence_terms(table, ref, responses):
    """log-probs (N, T), logits (N, T, W), ref log-probs, ref logits, mask, and P(y) (N,) with its gradient."""
    logits, ref_logits = table_logits(table, responses), table_logits(ref, responses)
    lp = torch.log_softmax(logits, -1).gather(2, responses[..., None])[..., 0]
    ref_lp = torch.log_softmax(ref_logits, -1).gather(2, responses[..., None])[..., 0]
    mask = response_mask(responses).to(D)
    prob = ((lp * mask).sum(1)).exp()
    return lp, logits, ref_lp, ref_logits, mask, prob


def true_sequence_grad(theta, ref, responses):
    t = theta.clone().requires_grad_()
    lp, _, ref_lp, _, mask, prob = sequence_terms(t, ref, responses)
    assert prob.sum().item() == pytest.approx(1.0, abs=1e-12)
    kl_seq = (prob * ((lp - ref_lp) * mask).sum(1)).sum()
    return torch.autograd.grad(kl_seq, t)[0]


def expected_sequence_grad(per_sequence, theta, ref, responses):
    """sum_y sg(P(y)) grad f(y) for f = per_sequence(lp, logits, ref_lp, ref_logits, mask) -> (N,)."""
    t = theta.clone().requires_grad_()
    lp, logits, ref_lp, ref_logits, mask, prob = sequence_terms(t, ref, responses)
    f = per_sequence(lp, logits, ref_lp.detach(), ref_logits.detach(), mask)
    return torch.autograd.grad((prob.detach() * f).sum(), t)[0]


def loss_side(config):
    def f(lp, logits, ref_lp, ref_logits, mask):
        return (K.loss_kl_terms(config, lp, lp.detach(), ref_lp, logits, ref_logits, mask) * mask).sum(1)

    return f


def reward_side(config, gamma=1.0):
    """The reward-side KL through REINFORCE++'s returns (no normalisation): sum_t log pi_t sg(-A^KL_t)."""

    def f(lp, logits, ref_lp, ref_logits, mask):
        kl = K.reward_kl(config, lp.detach(), ref_lp, logits.detach(), ref_logits, mask)
        params = AdvantageParams(gamma, 1.0, 1, normalize=False)
        credit, _ = ALGORITHMS["reinforce_pp"].advantages(-kl * mask, None, mask, params)
        return -(lp * credit * mask).sum(1)

    return f


def test_enumeration_covers_every_length(chain):
    _, _, responses = chain
    assert sorted(set(response_mask(responses).sum(1).tolist())) == [1.0, 2.0, 3.0]


def test_sequence_kl_surrogate_is_unbiased_for_the_sequence_kl_gradient(chain):
    theta, ref, responses = chain
    want = true_sequence_grad(theta, ref, responses)
    f = lambda lp, logits, ref_lp, ref_logits, mask: sequence_kl_surrogate(logits, ref_logits, lp, mask)
    torch.testing.assert_close(expected_sequence_grad(f, theta, ref, responses), want, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize(
    "variant, exact",
    [
        (dict(estimator="k2", return_to_go=True), True),
        (dict(estimator="full", return_to_go=True), True),
        (dict(estimator="k3+", return_to_go=True), True),
        (dict(estimator="k1+", return_to_go=True), True),
        (dict(estimator="k3", is_weight=True, return_to_go=True), True),
        (dict(estimator="k2"), False),  # a per-token loss misses the future KL
        (dict(estimator="full"), False),
        # k1 and k3 with return_to_go (the future KL alone; forward-KL per-token part) are refused by KLConfig
    ],
)
def test_loss_side_sequence_gradients(chain, variant, exact):
    theta, ref, responses = chain
    want = true_sequence_grad(theta, ref, responses)
    got = expected_sequence_grad(loss_side(kc(**variant)), theta, ref, responses)
    if exact:
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    else:
        assert (got - want).norm() > 1e-2 * want.norm()


@pytest.mark.parametrize("estimator, exact", [("k1", True), ("k3", False), ("k2", False)])
def test_reward_side_sequence_gradients(chain, estimator, exact):
    """k1 in the reward with gamma = 1 returns is REINFORCE on the sequence KL: exact. k2, k3 are not (Comedy)."""
    theta, ref, responses = chain
    want = true_sequence_grad(theta, ref, responses)
    got = expected_sequence_grad(reward_side(kc(estimator=estimator, placement="reward")), theta, ref, responses)
    if exact:
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    else:
        assert (got - want).norm() > 1e-2 * want.norm()


@pytest.mark.parametrize("estimator, exact", [("k1", True), ("k3", True), ("k2", False)])
def test_both_placements_sequence_gradients(chain, estimator, exact):
    """Reward side (returns) + loss side (per token, seq-sum): k1 and k3 give the exact sequence-KL gradient, since
    the reward side supplies the future KL with an unbiased value and the two per-token parts add to delta s."""
    theta, ref, responses = chain
    want = true_sequence_grad(theta, ref, responses)
    config = kc(estimator=estimator, placement="both")  # native: c = m; both helpers sum per sequence
    both = lambda *a: reward_side(config)(*a) + loss_side(config)(*a)
    got = expected_sequence_grad(both, theta, ref, responses)
    if exact:
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)
    else:
        assert (got - want).norm() > 1e-2 * want.norm()


# --- aggregation -----------------------------------------------------------------------------------------------------


def test_aggregations_hand_computed():
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    assert K.aggregate(x, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert K.aggregate(x, mask, "seq-mean-token-sum").item() == pytest.approx((6 + 4) / 2)
    assert K.aggregate(x, mask, "seq-mean-token-mean").item() == pytest.approx((2 + 4) / 2)


@pytest.mark.parametrize("pg_mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def test_reward_weights_give_the_loss_side_strength(mode, pg_mode):
    """One coefficient means the same strength in both places: a penalty c_t k_t credited through the returns to
    s_t with the policy loss's weight a_pg has weight a_pg c = a_mode, the loss side's (constant in a response).
    Before issue 18 c made the batch-mean penalty equal the loss aggregate, which ignored the policy loss's own
    token mean: the loss half of a token-mean 'both' arm was L-bar (3.000 vs 1.000 at L = 3) times the reward's."""
    g = torch.Generator().manual_seed(0)
    mask = response_mask(torch.tensor([[2, 3, 1, 1, 1, 1], [2, 2, 2, 2, 2, 2], [1, 1, 1, 1, 1, 1], [3, 1, 1, 1, 1, 1],
                                       [2, 2, 2, 1, 1, 1]])).to(D)  # fmt: skip
    k = torch.randn(5, 6, generator=g, dtype=D)
    c = K.reward_weights(mask, mode, pg_mode)
    assert ((c * (1 - mask)) == 0).all()
    torch.testing.assert_close(c * K.aggregation_weights(mask, pg_mode), K.aggregation_weights(mask, mode))
    torch.testing.assert_close((K.aggregation_weights(mask, mode) * k).sum(), K.aggregate(k, mask, mode))


def test_native_aggregations_follow_the_policy_loss():
    assert K.aggregation_of(kc(placement="reward")) == "token-mean"
    assert K.aggregation_of(kc(placement="loss"), "seq-mean-token-sum-norm") == "seq-mean-token-sum-norm"
    assert K.aggregation_of(kc(placement="both", aggregation="seq-mean-token-mean")) == "seq-mean-token-mean"
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert torch.equal(K.reward_weights(mask, "token-mean", "token-mean"), mask)  # today's per-token penalty


def test_return_to_go_hand_computed():
    kl = torch.tensor([[1.0, 2.0, 4.0, 8.0]], dtype=D)
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]], dtype=D)
    lp = torch.zeros(1, 4, dtype=D, requires_grad=True)
    term = K.kl_return_to_go(kl, lp, mask)
    assert term.abs().max().item() == 0.0  # value 0: it adds only a gradient
    term.sum().backward()
    assert lp.grad[0].tolist() == [6.0, 4.0, 0.0, 0.0]  # future KL after each token, within the mask


# --- moving reference ------------------------------------------------------------------------------------------------


def test_sync_reference_reset_and_ema():
    torch.manual_seed(0)
    ref, policy = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    before = [p.clone() for p in ref.parameters()]
    K.sync_reference(ref, policy, 0.25)
    for p_ref, p0, p in zip(ref.parameters(), before, policy.parameters()):
        torch.testing.assert_close(p_ref, 0.75 * p0 + 0.25 * p)
    K.sync_reference(ref, policy, 1.0)
    assert all(torch.equal(a, b) for a, b in zip(ref.parameters(), policy.parameters()))


def test_reference_due_every_n_iterations():
    config = kc(ref_sync_every=3, ref_sync_alpha=1.0)
    assert [i for i in range(1, 10) if K.reference_due(config, i)] == [3, 6, 9]
    assert not any(K.reference_due(kc(), i) for i in range(1, 10))

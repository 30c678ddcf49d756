"""rlhf.kl.CONTRACT checked by exact enumeration: every accepted KL combination's expected gradient, computed with
the project's own training functions, equals the row's formula and, where the row names one, its exact target.

The policy is tabular (logits per response prefix; vocabulary of 3 words, responses of exactly T = 3 tokens, so all
27 responses are enumerated with their probabilities, nothing sampled; BOS/EOS have logit -1e4, probability 0 in
float64). The expectation over batches is exact: the batch holds every response (or, for grpo/rloo, every group of
G = 2 responses) once, and the tabular module scales the gradient flowing into each row's logits by the row's
probability, so that the code's aggregate (a constant denominator at a fixed length) becomes the expectation. The
training path is the loop's: ``ppo.step_kl_reward`` -> ``kl.reward_penalty`` -> the algorithm's advantage
function (critic and normalisation neutralised: values 0, lam 1, no whitening; grpo keeps its std unless dr_grpo)
-> ``ppo.minibatch_loss`` (clipped surrogate with a clip range that never binds + the loss-side KL). Regimes:
on-policy (pi_old = pi_theta) and off-policy (samples from pi_old != pi_theta, gradient at pi_theta). float64.
"""

from __future__ import annotations

import itertools
import math
import types
import typing

import pytest
import torch
from pydantic import ValidationError
from torch import nn

from rlhf import kl as K
from rlhf import ppo
from rlhf.algorithms import ALGORITHMS, AdvantageParams
from rlhf.config import ALGORITHMS as ALGORITHM_NAMES
from rlhf.config import ESTIMATORS, IS_DIFFERENTIABLE, KLConfig, PPOConfig

from ..conftest import small_ppo_config

D = torch.float64
T, WORDS, V, G = 3, (2, 3, 4), 5, 2  # length, response tokens, vocabulary (BOS, EOS, words), group size
N_PREFIX = sum(len(WORDS) ** i for i in range(T))  # 13 prefixes of length 0..T-1
NEG = -1e4
ALGOS = (*ALGORITHM_NAMES, "dr_grpo")
TOL = 1e-9
WORST: dict[str, float] = {}  # row x regime -> worst |code - expected| / |expected| (printed by the last test)


def responses() -> torch.Tensor:
    return torch.tensor(list(itertools.product(WORDS, repeat=T)))  # (27, T)


class Tabular(nn.Module):
    """Logits of the next token given the response prefix, one row of ``table`` (N_PREFIX, 3) per prefix; the
    gradient into row b of the output is multiplied by ``scale[b]`` (the value is unchanged)."""

    def __init__(self, table: torch.Tensor, scale: torch.Tensor | None = None):
        super().__init__()
        self.table, self.scale = table, scale

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (b, 1 + T - 1) -> (b, T, V)
        b, length = tokens.shape
        cols = []
        for i in range(length):
            digits = tokens[:, 1 : i + 1] - WORDS[0]  # (b, i)
            code = sum((digits[:, j] * len(WORDS) ** (i - 1 - j) for j in range(i)), torch.zeros(b, dtype=torch.long))
            cols.append(self.table[(len(WORDS) ** i - 1) // (len(WORDS) - 1) + code])
        words = torch.stack(cols, 1)  # (b, T, 3)
        out = torch.cat([torch.full((b, length, V - len(WORDS)), NEG, dtype=D), words], dim=-1)
        if self.scale is not None:  # the value exactly unchanged, the gradient times scale
            out = out.detach() + (out - out.detach()) * self.scale[:, None, None]
        return out


@pytest.fixture(scope="module")
def tables():
    g = torch.Generator().manual_seed(18)
    theta = torch.randn(N_PREFIX, len(WORDS), generator=g, dtype=D)
    ref = theta + 0.9 * torch.randn(N_PREFIX, len(WORDS), generator=g, dtype=D)
    old = theta + 0.6 * torch.randn(N_PREFIX, len(WORDS), generator=g, dtype=D)
    return {"theta": theta, "ref": ref, "old": old}


# --- the code's expected gradient ---------------------------------------------------------------------------------


def code_gradient(kc: KLConfig, algo: str, theta, old, ref, **ppo_options) -> torch.Tensor:
    """E over batches of the gradient of ppo.minibatch_loss at theta with batches sampled from ``old``, per response
    and on the per-sequence scale (a mean aggregation multiplied by T)."""
    algorithm, dr = ("grpo", True) if algo == "dr_grpo" else (algo, False)
    grouped = algorithm in ("grpo", "rloo")
    ys = responses()
    q = _seq_logprob(old, ys).exp()  # (27,)
    if grouped:
        idx = torch.tensor(list(itertools.product(range(len(ys)), repeat=G)))  # (27^G, G)
        rho = q[idx].prod(1).repeat_interleave(G)
        rows = idx.reshape(-1)
    else:
        rho, rows = q, torch.arange(len(ys))
    n, g_eff = len(rows), G if grouped else 1
    resp, prompts, mask = ys[rows], torch.zeros(len(rows), 1, dtype=torch.long), torch.ones(len(rows), T, dtype=D)
    t = theta.clone().requires_grad_()
    policy = Tabular(t, rho * n / g_eff)
    with torch.no_grad():
        logits = ppo.response_logits(Tabular(old), prompts, resp, 1.0)
        ref_logits = ppo.response_logits(Tabular(ref), prompts, resp, 1.0)
        logprobs, ref_lp = ppo.logprobs_from_logits(logits, resp), ppo.logprobs_from_logits(ref_logits, resp)
    zeros = torch.zeros(n, dtype=D)
    traj = ppo.Trajectory(prompts, resp, mask, logits, logprobs, ref_logits, ref_lp, zeros, None, zeros)
    cfg = PPOConfig(
        algorithm=algorithm, iterations=1, batch_size=n, group_size=g_eff, minibatch_size=n, epochs=1, lr=1e-3,
        adam_eps=1e-5, temperature=1.0, gamma=1.0, lam=1.0, cliprange=1e6, cliprange_value=1.0, vf_coef=0.0,
        whiten_rewards=False, missing_eos_score=None, eval_every=1, eval_seed=0, seed=0, kl=kc, dr_grpo=dr,
        **ppo_options,
    )  # fmt: skip
    kl = K.resolve(kc, cfg.pg_mode)  # as train_ppo resolves it
    with torch.no_grad():
        if kl.remeasured:  # the loop re-measures with the current policy before later epochs
            cur = ppo.response_logits(Tabular(theta), prompts, resp, 1.0)
            kl_reward = ppo.step_kl_reward(traj, ppo.logprobs_from_logits(cur, resp), cur, kl)
        else:
            kl_reward = ppo.step_kl_reward(traj, traj.logprobs, traj.logits, kl)
        rewards = K.reward_penalty(kl_reward, 1.0, mask) if kl_reward is not None else torch.zeros_like(mask)
        params = AdvantageParams(1.0, 1.0, g_eff, normalize=algorithm == "grpo", group_std=not dr)
        advantages, _ = ALGORITHMS[algorithm].advantages(rewards, torch.zeros_like(rewards), mask, params)
    batch = ppo.Batch(kl_reward, rewards, advantages, None)
    loss, _ = ppo.minibatch_loss(policy, None, traj, batch, torch.arange(n), 1.0, cfg, kl)
    per_sequence = {"seq-mean-token-sum": 1.0}.get(kl.mode, float(T))
    return torch.autograd.grad(loss, t)[0] * per_sequence


# --- the row's formula and exact targets, by enumeration, independent of rlhf.kl and rlhf.ppo ----------------------


def _seq_logprob(table, ys) -> torch.Tensor:
    return _token_logprobs(table, ys).sum(1)


def _logits(table, ys) -> torch.Tensor:
    return Tabular(table)(torch.cat([torch.zeros(len(ys), 1, dtype=torch.long), ys[:, :-1]], 1))  # (N, T, V)


def _token_logprobs(table, ys) -> torch.Tensor:
    return torch.log_softmax(_logits(table, ys), -1).gather(2, ys[..., None])[..., 0]  # (N, T)


def _kl_positions(p_table, q_table, ys) -> torch.Tensor:
    """KL(p(.|y<t) || q(.|y<t)) at every position, (N, T), written out here (not rlhf.kl.full_kl)."""
    lp, lq = torch.log_softmax(_logits(p_table, ys), -1), torch.log_softmax(_logits(q_table, ys), -1)
    return (lp.exp() * (lp - lq)).sum(-1)


FUNCTIONS = {"exp": torch.exp, "abs": torch.abs, "sign": torch.sign}  # what rlhf.kl.FORMULAS may call


def _formula(expression: str, delta: torch.Tensor) -> torch.Tensor:
    """An expression of rlhf.kl.FORMULAS at ``delta`` (N, T)."""
    out = eval(
        expression, {"__builtins__": {}}, {"delta": delta, "exp": torch.exp, "abs": torch.abs, "sign": torch.sign}
    )
    return out * torch.ones_like(delta)  # a constant ('1') as a tensor


def test_every_sampled_token_estimator_has_its_formula():
    assert set(K.FORMULAS) == set(ESTIMATORS) - {"full"}
    delta = torch.linspace(-2.0, 2.0, 9, dtype=D)[:, None].requires_grad_()
    for est, f in K.FORMULAS.items():  # the code's value and per-sample gradient are the formula's
        code = K.kl_per_token(est, delta, torch.zeros_like(delta))
        torch.testing.assert_close(code, _formula(f.value, delta.detach()))
        (grad,) = torch.autograd.grad(code.sum(), delta)  # d k / d log pi_theta = the score coefficient
        torch.testing.assert_close(grad, _formula(f.score, delta.detach()))


def expected(kc: KLConfig, algo: str, theta, old, ref) -> dict[str, torch.Tensor]:
    """{'formula': the row's per-sample formula in expectation, 'seq', 'tok', 'tok_fwd', 'zero'}: per response,
    per unit coefficient, per-sequence scale."""
    ys = responses()
    target = ref if kc.target == "reference" else old
    t = theta.clone().requires_grad_()
    lp = _token_logprobs(t, ys)  # (N, T), with gradient
    q = _seq_logprob(old, ys).exp()  # sampling probabilities
    with torch.no_grad():
        lp_v, lq, lt = lp.detach(), _token_logprobs(old, ys), _token_logprobs(target, ys)
        delta, w = lp_v - lt, torch.exp(lp_v - lq)  # at theta; the ratio pi_theta / pi_old
        future = lambda x: x.flip(1).cumsum(1).flip(1) - x  # sum over t' > t
    sf = lambda f: (q[:, None] * f * lp).sum()  # E_q[sum_t f_t s_t] as a scalar whose gradient it is
    tok = (q[:, None] * _kl_positions(t, target, ys)).sum()
    tok_fwd = (q[:, None] * _kl_positions(target, t, ys)).sum()
    total = torch.zeros((), dtype=D)
    reward, loss = K.placement_coefs(kc, 1.0)
    if loss is not None:
        if kc.target == "old_policy_forward":
            total = total + tok_fwd
        elif kc.estimator == "full":
            total = total + tok
            if kc.return_to_go:
                total = total + sf(future(_kl_positions(theta, target, ys)))
        else:
            formula = K.FORMULAS[kc.estimator]
            f = _formula(formula.score, delta)  # E[sum_t c s_t]
            if kc.is_weight:  # a differentiable weight: grad (w k) = w (k + c) s; a detached one: sg(w) c s
                f = w * (_formula(formula.value, delta) + f if kc.estimator in IS_DIFFERENTIABLE else f)
            if kc.return_to_go:
                f = f + (w if kc.is_weight else 1.0) * future(delta)
            total = total + sf(f)
    if reward is not None:
        with torch.no_grad():  # the KL values the reward charges: the rollout's, or re-measured at theta
            measured = theta if kc.target == "old_policy" else old
            if kc.estimator == "full":
                k = _kl_positions(measured, target, ys)
            else:
                k = _formula(K.FORMULAS[kc.estimator].value, _token_logprobs(measured, ys) - lt)
            to_go = k + future(k)
        if algo == "grpo":  # the reward weight c (T for seq-mean-token-sum at a fixed length) cancels in the std
            c = float(T) if K.aggregation_of(kc) == "seq-mean-token-sum" else 1.0
            total = total + _grpo_std(c * k.sum(1), w, lp, q) / c
        else:
            total = total + sf(w * to_go) * ((G - 1) / G if algo == "dr_grpo" else 1.0)
    seq = (lp.sum(1).exp() * (lp.sum(1) - lt.sum(1))).sum()
    grad = lambda x: torch.autograd.grad(x, t, retain_graph=True, allow_unused=True)[0]
    return {"formula": grad(total), "seq": grad(seq), "tok": grad(tok), "tok_fwd": grad(tok_fwd),
            "zero": torch.zeros_like(theta)}  # fmt: skip


def _grpo_std(kl_sum, w, lp, q) -> torch.Tensor:
    """E over groups of (1/G) sum_i sum_t w s_t (K_i - mean K) / (std K + 1e-6), K = the response's KL sum."""
    idx = torch.tensor(list(itertools.product(range(len(q)), repeat=G)))  # (M, G)
    kk = kl_sum[idx]  # (M, G)
    a = (kk - kk.mean(1, keepdim=True)) / (kk.std(1, keepdim=True) + 1e-6)
    per = (w * lp).sum(1)[idx]  # (M, G): sum_t w_t log pi_t (gradient sum_t w s)
    return (q[idx].prod(1)[:, None] * a * per).sum() / G


# --- which combinations exist ----------------------------------------------------------------------------------------


def _domain(field: str) -> tuple | None:
    """Every value of a KLConfig field with a finite domain (a bool or a Literal, optionally None), the no-KL
    placement and the no-estimator None aside (the baseline has no contract); None for a numeric field."""
    info = KLConfig.model_fields[field]
    union = typing.get_origin(info.annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(info.annotation) if union else (info.annotation,)
    values: list = []
    for a in args:
        if a is bool:
            values += [False, True]
        elif typing.get_origin(a) is typing.Literal:
            values += [v for v in typing.get_args(a) if v != "none"]
        elif a is type(None):
            values.append(None)
        else:
            return None
    return tuple(v for v in values if not (v is None and info.is_required()))


# the fields enumerated: every KLConfig field with a finite domain (placement, estimator, is_weight, aggregation,
# return_to_go, target; a new bool or Literal option joins by itself); the numeric ones (coef, the clamp, the moving
# reference, the controller) are value modifiers, tested apart
FIELDS = tuple(f for f in KLConfig.model_fields if _domain(f) is not None)


def accepted_combinations() -> list[tuple[KLConfig, str]]:
    """Every (KLConfig, algorithm) the schema accepts over the FIELDS' domains x algorithm."""
    out = []
    for values in itertools.product(*(_domain(f) for f in FIELDS), ALGOS):
        try:
            kc = KLConfig(**dict(zip(FIELDS, values[:-1])), coef=1.0)
        except ValidationError:
            continue
        out.append((kc, values[-1]))
    return out


COMBOS = accepted_combinations()


def test_every_accepted_combination_has_exactly_one_row():
    """A new option cannot be added without its row: every combination the schema accepts is covered once."""
    assert len(COMBOS) > 500
    for kc, algo in COMBOS:
        rows = K.contract_rows(kc, algo)
        assert len(rows) == 1, (kc, algo, rows)


def test_every_row_covers_an_accepted_combination():
    covered = {K.CONTRACT.index(K.contract_rows(kc, a)[0]) for kc, a in COMBOS}
    assert covered == set(range(len(K.CONTRACT)))


def test_refused_combinations_name_the_keys():
    with pytest.raises(ValidationError, match="estimator 'full' with placement 'reward'"):
        KLConfig(target="reference", placement="reward", estimator="full", coef=1.0)


# --- one test per row and regime ---------------------------------------------------------------------------------


def _combos_of(i: int) -> list[tuple[KLConfig, str]]:
    return [(kc, a) for kc, a in COMBOS if K.contract_rows(kc, a)[0] is K.CONTRACT[i]]


def _cover(combos: list[tuple[KLConfig, str]]) -> list[tuple[KLConfig, str]]:
    """A subset in which every value of every field (and every algorithm) of the row appears at least once."""
    seen, out = set(), []
    for kc, algo in combos:
        new = {(f, getattr(kc, f)) for f in FIELDS} | {("algorithm", algo)}
        if not new <= seen:
            seen |= new
            out.append((kc, algo))
    return out


@pytest.mark.parametrize("regime", ["on_policy", "off_policy"])
@pytest.mark.parametrize("i", range(len(K.CONTRACT)))
def test_row_expected_gradient(tables, i, regime):
    """Every value of every field of the row at least once (the slow test below runs every combination)."""
    WORST[f"{i}:{regime}"] = check_row(tables, i, regime, _cover(_combos_of(i)))


@pytest.mark.slow
@pytest.mark.parametrize("regime", ["on_policy", "off_policy"])
@pytest.mark.parametrize("i", range(len(K.CONTRACT)))
def test_row_expected_gradient_every_combination(tables, i, regime):
    check_row(tables, i, regime, _combos_of(i))


def check_row(tables, i: int, regime: str, combos) -> float:
    """Asserts the row on ``combos`` in ``regime``; returns the worst relative deviation."""
    row = K.CONTRACT[i]
    theta, ref = tables["theta"], tables["ref"]
    old = theta if regime == "on_policy" else tables["old"]
    key = row.on_key if regime == "on_policy" else row.off_key
    worst = 0.0
    for kc, algo in combos:
        got = code_gradient(kc, algo, theta, old, ref)
        want = expected(kc, algo, theta, old, ref)
        scale = max(want["formula"].norm().item(), 1e-3)
        dev = (got - want["formula"]).norm().item() / scale
        assert dev < TOL, (kc, algo, dev)
        if key:  # the row names an exact quantity: the formula equals it
            named = (want["formula"] - want[key]).norm().item() / max(want[key].norm().item(), 1e-3)
            assert named < TOL, (kc, algo, key, named)
            dev = max(dev, (got - want[key]).norm().item() / max(want[key].norm().item(), 1e-3))
        worst = max(worst, dev)
    return worst


def test_biased_rows_are_biased(tables):
    """Guards the exact ones: where a row says 'biased' on-policy, the formula is not the sequence-KL gradient."""
    theta, ref = tables["theta"], tables["ref"]
    for i, row in enumerate(K.CONTRACT):
        if not row.on_policy.startswith("biased"):
            continue
        kc, algo = next((kc, a) for kc, a in _combos_of(i) if kc.target == "reference")
        want = expected(kc, algo, theta, theta, ref)
        assert (want["formula"] - want["seq"]).norm() > 1e-2 * want["seq"].norm(), (i, row.estimator)


def test_kl_clamp_is_exact_inside_and_zero_beyond(tables):
    theta, ref = tables["theta"], tables["ref"]
    base = dict(target="reference", placement="loss", estimator="k3", coef=1.0, is_weight=True)
    plain = code_gradient(KLConfig(**base), "ppo", theta, tables["old"], ref)
    wide = code_gradient(KLConfig(**base, kl_clamp=1e6), "ppo", theta, tables["old"], ref)
    tight = code_gradient(KLConfig(**base, kl_clamp=1e-12), "ppo", theta, tables["old"], ref)
    assert torch.equal(plain, wide) and tight.norm() < 1e-9 * plain.norm()


def test_report_worst_deviation():
    """Prints rows x regimes and the worst relative deviation (run after the row tests, as pytest orders them)."""
    if WORST:
        print(f"\ncontract: {len(K.CONTRACT)} rows x 2 regimes = {len(WORST)} tests over {len(COMBOS)} combinations; "
              f"worst relative deviation {max(WORST.values()):.2e}")  # fmt: skip
        assert max(WORST.values()) < TOL and not math.isnan(max(WORST.values()))


def test_the_readme_shows_the_contract_table():
    """The README's table is generated (pipelines/readme.py splices rlhf.kl.contract_markdown() in)."""
    from pathlib import Path

    from pipelines import readme

    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert readme.splice(text, readme.contract_table(), readme.CONTRACT_BEGIN, readme.CONTRACT_END) == text
    assert "a push away from pi_old" in K.contract_markdown()  # row 1: a descent step raises CE(pi_old, pi)


@pytest.mark.parametrize(
    "options",
    [dict(ratio_level="sequence", pg_aggregation="seq-mean-token-mean"), dict(cliprange_high=0.28, dual_clip=3.0),
     dict(pg_aggregation="seq-mean-token-mean"), dict(entropy_coef=None)],
)  # fmt: skip
@pytest.mark.parametrize("kl", [dict(placement="reward", estimator="k1"), dict(placement="both", estimator="k3")])
def test_policy_loss_options_keep_the_on_policy_contract(tables, options, kl):
    """On-policy (ratio 1, nothing clipped) GSPO's sequence ratio, clip-higher, dual-clip and a per-response policy
    aggregation leave the exact rows exact: the KL gradient is still g_seq (the KL's native aggregation follows
    pg_aggregation, equal in both places). Off-policy they change the reward side's weighting (not in CONTRACT)."""
    theta, ref = tables["theta"], tables["ref"]
    kc = KLConfig(target="reference", coef=1.0, **kl)
    got = code_gradient(kc, "ppo", theta, theta, ref, **options)
    want = expected(kc, "ppo", theta, theta, ref)["seq"]
    assert (got - want).norm().item() < TOL * want.norm().item()


def test_row_1_off_policy_a_descent_step_pushes_pi_away_from_pi_old(tables):
    """k1 in the loss off-policy: E_old[sum_t s_t] = -grad CE(pi_old, pi), so a step against it raises CE(pi_old, pi)
    (row 1's wording, issue 30; "a pull toward pi_old" was the wrong sign)."""
    theta, old, ref = tables["theta"], tables["old"], tables["ref"]
    kc = KLConfig(target="reference", placement="loss", estimator="k1", coef=1.0)
    grad = code_gradient(kc, "ppo", theta, old, ref)
    ys = responses()
    p_old = _seq_logprob(old, ys).exp()
    assert -(p_old * _seq_logprob(theta - 1e-3 * grad, ys)).sum() > -(p_old * _seq_logprob(theta, ys)).sum()


def _gspo_gradients(theta, old, pg_aggregation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the code's expected policy gradient, GSPO's) for responses of lengths 1..3 sampled from ``old``, fixed
    advantages A(y), off-policy, nothing clipped. GSPO (arXiv 2507.18071 eq. 5-7): J = E_old[A(y) s(y)] with
    s(y) = (pi(y) / pi_old(y))^(1/|y|): each response weighted 1/G whatever its length."""
    ys = responses()
    n = len(ys)
    mask = (torch.arange(T)[None, :] < (1 + ys[:, :1] % T)).to(D)  # (27, T): lengths 1, 2, 3
    adv = torch.linspace(-1.0, 1.0, n, dtype=D)[:, None] * torch.ones(1, T, dtype=D)
    q = _seq_logprob(old, ys).exp()
    t = theta.clone().requires_grad_()
    prompts = torch.zeros(n, 1, dtype=torch.long)
    lp = ppo.logprobs_from_logits(ppo.response_logits(Tabular(t, q * n), prompts, ys, 1.0), ys)
    with torch.no_grad():
        old_lp = ppo.logprobs_from_logits(ppo.response_logits(Tabular(old), prompts, ys, 1.0), ys)
    loss, _, _ = ppo.policy_loss(lp, old_lp, adv, mask, 1e6, ratio_level="sequence", mode=pg_aggregation)
    code = torch.autograd.grad(loss, t)[0]
    u = theta.clone().requires_grad_()
    s = torch.exp(((_token_logprobs(u, ys) - _token_logprobs(old, ys)) * mask).sum(1) / mask.sum(1))
    gspo = torch.autograd.grad(-(q * adv[:, 0] * s).sum(), u)[0]
    return code, gspo


def test_gspo_is_exact_with_its_aggregation_and_refused_without(tables):
    """Issue 30's flag: the sequence ratio with a token-mean policy loss weights response y by |y| / mean length
    instead of 1/G (not GSPO's objective); with seq-mean-token-mean it is GSPO's gradient exactly, and params
    validation refuses the other aggregations in one line."""
    code, gspo = _gspo_gradients(tables["theta"], tables["old"], "seq-mean-token-mean")
    assert (code - gspo).norm() < TOL * gspo.norm()
    code, _ = _gspo_gradients(tables["theta"], tables["old"], "token-mean")
    assert (code - gspo).norm() > 0.05 * gspo.norm()
    for options in (dict(), dict(pg_aggregation="token-mean"), dict(algorithm="grpo", group_size=2, dr_grpo=True)):
        with pytest.raises(ValidationError, match="ratio_level 'sequence'") as e:
            small_ppo_config(ratio_level="sequence", **options)
        assert e.value.error_count() == 1

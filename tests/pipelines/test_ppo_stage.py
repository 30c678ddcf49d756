"""What the cell stage (pipelines/ppo.py) logs to MLflow from a run's gradient diagnostics."""

from __future__ import annotations

import copy

from pipelines import tracking
from pipelines.ppo import diagnostic_metrics
from rlhf.ppo import train_ppo
from tests.conftest import small_ppo_config


class BatchRecorder:
    """The one MlflowClient method ``tracking.log_metrics`` calls, keeping every metric it is given."""

    def __init__(self):
        self.metrics = []

    def log_batch(self, run_id, metrics):
        self.metrics += metrics


def test_diagnostics_rows_log_as_numbers_per_regime_and_target(ppo_setup):
    """Regression (issue 18 added the string column ``against``): every diagnostic row of a real run, against the
    frozen reference and against a moving reference's own target, logs as float metrics under
    diagnostics/<regime>/ or diagnostics/<regime>_own/, the labels never as metrics. Before the fix every KL cell
    with diagnostics failed in write_outputs with "could not convert string to float: 'reference'"."""
    kl = dict(placement="reward", estimator="k1", ref_sync_every=1, ref_sync_alpha=0.5)  # rows against 'own' too
    s = ppo_setup
    cfg = small_ppo_config(kl=kl, diagnostics=dict(at=[2], n_true=16, n_minibatches=2, seed=0))
    models = copy.deepcopy((s.policy, s.ref, s.reward_model))  # a moving reference is updated in place
    out = train_ppo(*models, s.grammar, s.train_prompts, s.eval_prompts, cfg)
    groups = diagnostic_metrics(out["diagnostics"])
    assert set(groups) == {f"diagnostics/{r}{o}/" for r in ("on_policy", "off_policy") for o in ("", "_own")}
    client = BatchRecorder()
    for prefix, rows in groups.items():
        tracking.log_metrics(client, "run", rows, prefix=prefix)
    names = {m.key for m in client.metrics}
    assert "diagnostics/on_policy/cosine" in names and "diagnostics/off_policy_own/cosine" in names
    assert not any(n.endswith(("/regime", "/against")) for n in names)
    assert all(isinstance(m.value, float) and m.step == 2 for m in client.metrics)
    assert len(client.metrics) == sum(len(r) - 3 for r in out["diagnostics"])  # all but iteration, regime, against

"""The one workload the speed benchmarks time: the reference arm at the grammar task's middle coefficient (its
exploratory ``coefs``, else, as in the default params.yaml where there are none, its calibration coefficients),
first seed, instance 0. A helper module of the scripts here (they run with this folder on sys.path), not a script.
"""

from __future__ import annotations

from typing import NamedTuple

from ablations.grid import cell_config
from rlhf.config import KLConfig, PPOConfig


class Reference(NamedTuple):
    name: str  # e.g. "grammar reward_k1 at coef 0.03, seed 0"
    kl: KLConfig
    seed: int
    config: PPOConfig  # the task's PPO settings with this KL and seed


def reference(params, task: str) -> Reference:
    section = getattr(params, task)
    coefs = section.coefs or section.calibration.coefs
    coef, arm, seed = coefs[len(coefs) // 2], params.analysis.reference_arm, params.grid.seeds[0]
    config = cell_config(params, task, arm, seed, coef=coef)  # as the grid builds a cell's config
    return Reference(f"{task} {arm} at coef {coef:g}, seed {seed}", config.kl, seed, config)

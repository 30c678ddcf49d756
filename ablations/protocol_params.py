"""How to judge: the ``analysis`` section of params.yaml (ablations/questions.py, ablations/primary.py,
ablations/sequential.py), fixed before the runs it judges; no value has a default. Only the calibration and analysis
stages read it, so a protocol change re-runs those and no cell. ablations/config.py validates it with the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from pydantic import BaseModel, Field, FiniteFloat, field_validator, model_validator

from ablations.section import STRICT, _distinct
from ablations.tasks import TASKS

MetricName = Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")]


class TaskAnalysis(BaseModel):
    """The protocol of one task (ablations/questions.py, ablations/primary.py). The margins are not written here:
    the calibration stage fixes them on the calibration instances (protocol/<task>.json), as a share of the no-KL
    gain; ``Judged`` is this section with them filled in."""

    model_config = STRICT
    metrics: list[MetricName] = Field(description="compared metrics; 'gold' is the primary metric")
    kl_tolerance: FiniteFloat = Field(
        gt=0.0, lt=1.0, description="a steered run hits its KL level when |final KL / level - 1| <= this"
    )

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, m):
        if "gold" not in m:
            raise ValueError(f"must list the primary metric 'gold' (got {m})")
        if "kl" in m or "log_kl" in m:
            raise ValueError("'log_kl' has its own calibrated margin (calibration.log_kl_fraction); list gold metrics")
        return _distinct("metric", m)


@dataclass(frozen=True)
class Judged:
    """A task's protocol with the calibrated margins filled in (what the analysis uses). ``collapse_drop``: a run
    collapses when its final gold is below its SFT gold by more than the gold margin (a smaller drop is "no
    difference" by the protocol's own margin)."""

    metrics: tuple[str, ...]
    margins: dict[str, float]  # every metric's calibrated margin, log_kl included
    kl_tolerance: float

    @property
    def collapse_drop(self) -> float:
        return self.margins["gold"]


class SequentialParams(BaseModel):
    """Instances added in batches until each primary comparison is settled or reaches its planned cap
    (ablations/sequential.py; the plan: ablations/plan.py)."""

    model_config = STRICT
    batch_size: int = Field(ge=1, le=1_000, description="evaluation instances per batch (a look after each)")
    max_cap: int = Field(ge=1, le=10_000, description="the most evaluation instances any comparison may plan for")
    power: FiniteFloat = Field(gt=0.0, lt=1.0, description="the plan: power to settle a difference of `effect`")
    effect: FiniteFloat = Field(gt=1.0, le=10.0, description="the plan's true difference, in margins")
    simulations: int = Field(ge=100, le=1_000_000, description="Monte Carlo trials per planned cap")

    @model_validator(mode="after")
    def _multiple(self):
        if self.max_cap % self.batch_size:
            raise ValueError(f"max_cap ({self.max_cap}) must be a multiple of batch_size ({self.batch_size})")
        return self


PRIMARY_METRICS = ("gold", "log_kl")
NO_KL = "none"  # the no-KL baseline as a question's ``other``: its own trajectory, read at each KL level


class Primary(BaseModel):
    """One pre-registered primary question: ``arm`` minus ``other``, each at ``role`` (the cell the calibration fixed
    for it: ``act`` the coefficient where the penalty acts, ``tuned`` each arm's own best coefficient, ``levels`` one
    comparison per frontier KL level, each arm steered there), on ``metric``. ``other: none`` with ``levels`` is the
    no-KL run's own gold-KL trajectory read at each level (Gao et al. 2022, sec. 3.6). ``kind`` says what it
    isolates: ``placement`` questions carry the headline; ``penalty`` (does a KL penalty help at all) and
    ``practice`` (the camps' defaults, estimator and coefficient changing with the placement) are reported beside it
    under the same error budget."""

    model_config = STRICT
    arm: str
    other: str
    role: Literal["act", "tuned", "levels"]
    metric: Literal["gold", "log_kl"]
    kind: Literal["placement", "penalty", "practice"]

    @model_validator(mode="after")
    def _none(self):
        if self.other == NO_KL and self.role != "levels":
            raise ValueError("other 'none' (the no-KL trajectory) is read at the frontier's levels: role 'levels'")
        return self


class AnalysisParams(BaseModel):
    """The statistics protocol (ablations/questions.py), fixed before the runs it judges; no value has a default."""

    model_config = STRICT
    reference_arm: str = Field(min_length=1)
    alpha: FiniteFloat = Field(gt=0.0, lt=0.5, description="family-wise level of every primary claim of a task")
    power: FiniteFloat = Field(gt=0.0, lt=1.0, description="exploratory: for 'instances needed'")
    min_hit_rate: FiniteFloat = Field(gt=0.0, le=1.0, description="below it an arm is 'not steerable' at a level")
    bimodality_alpha: FiniteFloat = Field(gt=0.0, lt=1.0, description="per-cell flag of two separated groups")
    sequential: SequentialParams
    primary: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], Primary] = Field(
        description="the pre-registered questions (a 'levels' question is one comparison per level)"
    )
    checks: dict[Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]*$")], Primary] = Field(
        description="sanity checks of the contract on the planning instances: reported, no error budget"
    )
    tasks: dict[str, TaskAnalysis]

    @field_validator("primary")
    @classmethod
    def _primary(cls, p):
        if not p:
            raise ValueError("must pre-register at least one primary question")
        if not any(q.kind == "placement" for q in p.values()):
            raise ValueError("must pre-register at least one placement question (the headline)")
        return p

    def judged(self, task: str, margins: dict[str, float]) -> Judged:
        """``task``'s protocol with the calibrated ``margins`` (protocol/<task>.json; log_kl's among them)."""
        tp = self.tasks[task]
        missing = [m for m in (*tp.metrics, "log_kl") if m not in margins]
        if missing:
            raise ValueError(f"task {task}: the calibration gives no margin for {', '.join(missing)}")
        return Judged(tuple(tp.metrics), {m: float(v) for m, v in margins.items()}, tp.kl_tolerance)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, t):
        if not t:
            raise ValueError("must name at least one task")
        return t


def check_metrics(tasks: dict[str, TaskAnalysis]) -> None:
    """Every protocol names a task and compares only metrics that task has (ablations.tasks.TASKS; the calibration
    stage sets their margins as a share of the no-KL gain, so no margin is written by hand)."""
    for task, tp in tasks.items():
        if task not in TASKS:
            raise ValueError(f"analysis.tasks.{task}: not a task; allowed: {', '.join(TASKS)}")
        allowed = TASKS[task].metrics
        for metric in tp.metrics:
            if metric not in allowed:
                key = f"analysis.tasks.{task}.metrics"
                raise ValueError(f"{key}: task {task} has no metric {metric!r}; allowed: {', '.join(allowed)}")

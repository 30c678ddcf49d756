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
    min_log_kl_reduction: FiniteFloat = Field(
        gt=0.0, le=10.0, description="Q1: smallest meaningful change of log final KL (the Q1 margin)"
    )
    kl_tolerance: FiniteFloat = Field(
        gt=0.0, lt=1.0, description="Q3: a run hits its KL target when |final KL / target - 1| <= this"
    )

    @field_validator("metrics")
    @classmethod
    def _metrics(cls, m):
        if "gold" not in m:
            raise ValueError(f"must list the primary metric 'gold' (got {m})")
        if "kl" in m or "log_kl" in m:
            raise ValueError("'kl' is judged by Q1 (min_log_kl_reduction), not by an equivalence margin")
        return _distinct("metric", m)


@dataclass(frozen=True)
class Judged:
    """A task's protocol with the calibrated margins filled in (what the analysis uses). ``collapse_drop``: a run
    collapses when its final gold is below its SFT gold by more than the gold margin (a smaller drop is "no
    difference" by the protocol's own margin)."""

    metrics: tuple[str, ...]
    margins: dict[str, float]
    min_log_kl_reduction: float
    kl_tolerance: float

    @property
    def collapse_drop(self) -> float:
        return self.margins["gold"]


class SequentialParams(BaseModel):
    """Instances added in batches until each primary question is settled (ablations/sequential.py)."""

    model_config = STRICT
    batch_size: int = Field(ge=1, le=1_000, description="evaluation instances per batch (a look after each)")
    cap: int = Field(ge=1, le=10_000, description="the most evaluation instances a task gets (a multiple of batch)")
    rho: FiniteFloat = Field(gt=0.0, le=10.0, description="alpha spent by look j of J: alpha * (j/J)^rho")

    @model_validator(mode="after")
    def _multiple(self):
        if self.cap % self.batch_size:
            raise ValueError(f"cap ({self.cap}) must be a multiple of batch_size ({self.batch_size})")
        return self


PRIMARY_METRICS = ("gold", "log_kl")


class Primary(BaseModel):
    """One question's pre-registered primary comparison: ``arm`` minus ``other``, each at ``role`` (the cell the
    calibration fixed for it), on ``metric`` (final gold, or log final exact KL for restraint)."""

    model_config = STRICT
    arm: str
    other: str
    role: Literal["coef", "tuned", "target"]
    metric: Literal["gold", "log_kl"]


class AnalysisParams(BaseModel):
    """The statistics protocol (ablations/questions.py), fixed before the runs it judges; no value has a default."""

    model_config = STRICT
    reference_arm: str = Field(min_length=1)
    alpha: FiniteFloat = Field(gt=0.0, lt=0.5, description="family-wise level (Holm); TOST at alpha with a 90% CI")
    power: FiniteFloat = Field(gt=0.0, lt=1.0, description="for 'instances needed'")
    min_hit_rate: FiniteFloat = Field(gt=0.0, le=1.0, description="Q3: below it an arm is 'not steerable'")
    bimodality_alpha: FiniteFloat = Field(gt=0.0, lt=1.0, description="per-cell flag of two separated groups")
    sequential: SequentialParams
    primary: dict[Literal["Q1", "Q2", "Q3", "Q4"], Primary] = Field(description="one per question: the headline")
    tasks: dict[str, TaskAnalysis]

    @field_validator("primary")
    @classmethod
    def _primary(cls, p):
        if not p:
            raise ValueError("must pre-register at least one primary comparison")
        return p

    def judged(self, task: str, margins: dict[str, float]) -> Judged:
        """``task``'s protocol with the calibrated ``margins`` (protocol/<task>.json)."""
        tp = self.tasks[task]
        missing = [m for m in tp.metrics if m not in margins]
        if missing:
            raise ValueError(f"task {task}: the calibration gives no margin for {', '.join(missing)}")
        return Judged(tuple(tp.metrics), {m: float(margins[m]) for m in tp.metrics}, tp.min_log_kl_reduction,
                      tp.kl_tolerance)  # fmt: skip

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

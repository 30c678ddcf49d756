"""`make settle` (pipelines/settle.py): the next batch of evaluation instances, appended to params.yaml while a
primary question is open. Fast: the pipeline runner is a stand-in that writes each task's stats.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ablations.config import ParamsError, load_params
from pipelines import settle

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def repo(params_copy) -> Path:
    """A directory with the repository's params.yaml, its evaluation instances reset to the first batch (grammar and
    arithmetic: 100-103, batches of 4; the repository's own may have more after `make settle`), as cwd."""
    text = re.sub(r"(?m)^(  instances: )\[[0-9, ]+\]", r"\1[100, 101, 102, 103]", (ROOT / "params.yaml").read_text())
    (params_copy / "params.yaml").write_text(text)
    return params_copy


def write_stats(root: Path, task: str, statuses: dict[str, str]) -> None:
    primary = {q: {"verdict": "inconclusive" if s != "settled" else "material difference", "status": s, "n": 4}
               for q, s in statuses.items()}  # fmt: skip
    path = root / "reports" / task / "stats.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"n_runs": 1, "primary": primary}))


def test_next_batch_continues_the_sequence_after_the_last_instance():
    assert settle.next_batch([100, 101, 102, 103], 4) == [104, 105, 106, 107]
    assert settle.next_batch([10, 11], 2) == [12, 13]
    assert settle.next_batch([7], 1) == [8]


def test_extend_appends_the_next_batch_and_keeps_comments(repo):
    before = (repo / "params.yaml").read_text()
    assert settle.extend("grammar", repo / "params.yaml") == [104, 105, 106, 107]
    after = (repo / "params.yaml").read_text()
    p = load_params(repo / "params.yaml")
    assert p.grammar.instances == [100, 101, 102, 103, 104, 105, 106, 107]
    assert p.arithmetic.instances == [100, 101, 102, 103]  # the other task is untouched
    assert "# EVALUATION task seeds" in after and "# params.yaml: the one file to edit" in after
    # nothing but the instances changed: every other line is the same
    assert [line for line in after.splitlines() if "instances" not in line] == [
        line for line in before.splitlines() if "instances" not in line
    ]
    assert settle.extend("grammar", repo / "params.yaml") == [108, 109, 110, 111]
    assert sorted(p.name for p in repo.iterdir()) == ["params.yaml"]  # no temporary file left


def test_extend_refuses_a_calibration_seed_and_writes_nothing(repo):
    text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(
        text.replace("instances: [0, 1, 2]  # calibration task seeds (every", "instances: [0, 1, 106]  # (every", 1)
    )
    text = (repo / "params.yaml").read_text()
    assert load_params(repo / "params.yaml").grammar.calibration.instances == [0, 1, 106]
    with pytest.raises(ParamsError, match=r"^grammar: the next evaluation seeds \[106\] are calibration instances$"):
        settle.extend("grammar", repo / "params.yaml")
    assert (repo / "params.yaml").read_text() == text


def test_extend_past_the_cap_is_refused_by_validation_and_writes_nothing(repo):
    text = (repo / "params.yaml").read_text()
    (repo / "params.yaml").write_text(text.replace("cap: 24 ", "cap: 4 ", 1))
    text = (repo / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"with grammar batch \[104, 105, 106, 107\].*at most the cap \(4\)"):
        settle.extend("grammar", repo / "params.yaml")
    assert (repo / "params.yaml").read_text() == text


def test_open_questions_reads_the_status_of_each_primary_question(tmp_path):
    reports = tmp_path / "reports"
    assert settle.open_questions("grammar", reports) == []  # no report yet
    write_stats(tmp_path, "grammar", {"Q1": "settled", "Q2": "open", "Q3": "unsettled at cap", "Q4": "open"})
    assert settle.open_questions("grammar", reports) == ["Q2", "Q4"]
    assert settle.open_questions("arithmetic", reports) == []
    write_stats(tmp_path, "grammar", {"Q1": "settled"})
    assert settle.open_questions("grammar", reports) == []


class FakeRunner:
    """Stands in for `python -m pipelines.run`: records its arguments and the instances of each task, and writes
    each task's stats.json, with every primary question open until the task has ``settled_at`` instances (a task
    it does not name: settled at its first batch)."""

    def __init__(self, settled_at: dict[str, int], rc: int = 0):
        self.settled_at, self.rc, self.calls = settled_at, rc, []

    def __call__(self, cmd: list[str], **popen) -> int:
        assert cmd[:3] == [sys.executable, "-m", "pipelines.run"]
        p = load_params()
        self.calls.append((cmd[3:], {t: list(s.instances) for t, s in p.tasks().items()}))
        for task, section in p.tasks().items():
            done = len(section.instances) >= self.settled_at.get(task, 4)
            write_stats(Path("."), task, {q: "settled" if done else "open" for q in ("Q1", "Q2")})
        return self.rc


def test_settle_adds_batches_to_the_open_task_until_settled(repo, monkeypatch, capsys):
    fake = FakeRunner({"grammar": 12, "arithmetic": 4})
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main(["--", "--workers", "2"]) == 0
    assert [args for args, _ in fake.calls] == [["--workers", "2"]] * 3  # the runner's arguments passed on
    assert [seen["grammar"][-1] for _, seen in fake.calls] == [103, 107, 111]  # a batch of 4 before each rerun
    assert all(seen["arithmetic"] == [100, 101, 102, 103] for _, seen in fake.calls)  # settled: never extended
    assert load_params().grammar.instances == list(range(100, 112))
    out = capsys.readouterr().out
    assert "settle: grammar has open questions Q1, Q2: adding instances [104, 105, 106, 107]" in out
    assert "settle: grammar has open questions Q1, Q2: adding instances [108, 109, 110, 111]" in out
    assert "settle: grammar: Q1 material difference (settled, n = 4); Q2 material difference" in out
    assert "arithmetic has open questions" not in out


def test_settle_stops_after_the_given_number_of_batches(repo, monkeypatch, capsys):
    fake = FakeRunner({"grammar": 100, "arithmetic": 100})  # never settled
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main(["--batches", "1"]) == 0
    assert len(fake.calls) == 2  # run, one batch per task, run (its results read), stop
    assert load_params().grammar.instances == load_params().arithmetic.instances == list(range(100, 108))
    assert "settle: arithmetic: Q1 inconclusive (open, n = 4)" in capsys.readouterr().out


def test_a_failing_run_stops_settle_with_its_exit_status_and_adds_nothing(repo, monkeypatch):
    text = (repo / "params.yaml").read_text()
    fake = FakeRunner({"grammar": 100, "arithmetic": 100}, rc=3)
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main([]) == 3
    assert len(fake.calls) == 1 and (repo / "params.yaml").read_text() == text


def test_settle_stops_in_one_line_when_the_next_batch_is_refused(repo, monkeypatch, capsys):
    text = (
        (repo / "params.yaml")
        .read_text()
        .replace("instances: [0, 1, 2]  # calibration task seeds (every", "instances: [0, 1, 105]  # (every", 1)
    )
    (repo / "params.yaml").write_text(text)
    fake = FakeRunner({"grammar": 100, "arithmetic": 4})
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main([]) == 2
    err = capsys.readouterr().err
    assert err == "error: grammar: the next evaluation seeds [105] are calibration instances\n", err
    assert (repo / "params.yaml").read_text() == text and len(fake.calls) == 1


def test_settle_with_no_analysis_runs_once_and_adds_no_batch(repo, monkeypatch, capsys):
    """Issue 30: `settle -- --no-analysis` added a batch without looking, then failed on a missing stats.json."""
    text = (repo / "params.yaml").read_text()
    calls = []
    monkeypatch.setattr(settle.subprocess, "call", lambda cmd, **popen: calls.append(cmd) or 0)  # writes no report
    assert settle.main(["--", "--no-analysis"]) == 0
    assert len(calls) == 1 and calls[0][-1] == "--no-analysis"
    assert (repo / "params.yaml").read_text() == text
    assert "no batch added" in capsys.readouterr().out


def test_killing_settle_even_by_sigkill_stops_its_runner(repo):
    """Issue 30: SIGKILL to `make settle` left its runner running (parent pid 1), holding the runner lock."""
    import os
    import signal
    import subprocess
    import time

    from tests.pipelines.procs import HANG_S, alive, children, wait_for

    runner = "import time; time.sleep(600)  # pipelines.run"
    script = (
        "import sys; from pipelines import settle; "
        f"settle.RUNNER = [sys.executable, '-c', {runner!r}]; sys.exit(settle.main([]))"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=repo, env={**os.environ, "PYTHONPATH": str(ROOT)})
    child = None
    try:
        wait_for(lambda: children(proc.pid, b"pipelines.run"), timeout=HANG_S)
        (child,) = children(proc.pid, b"pipelines.run")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 60
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not alive(child), "the runner outlived settle"
    finally:
        proc.kill()
        if child is not None and alive(child):
            os.kill(child, signal.SIGKILL)

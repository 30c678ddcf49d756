"""`make settle` (pipelines/settle.py): the next batch of evaluation instances, appended to params.yaml while a
primary comparison is open, to the instances and to the design groups an open comparison reads (per-question
allocation). Fast: the pipeline runner is a stand-in that writes each task's stats.json."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

from ablations.config import ParamsError, load_params
from ablations.primary import CLOSED
from pipelines import settle

ROOT = Path(__file__).resolve().parents[2]


FIRST = [124, 125, 126, 127]  # the first batch of evaluation instances (batches of 4)


@pytest.fixture
def repo(params_copy) -> Path:
    """A directory with the repository's params.yaml, its evaluation instances and every non-empty design-group
    allocation reset to the first batch (grammar and arithmetic: 124-127; the repository's own may have more after
    `make settle`), as cwd."""
    first = "[" + ", ".join(map(str, FIRST)) + "]"
    groups = "|".join(load_params(ROOT / "params.yaml").grammar.allocation)
    line = rf"(?m)^(  instances: |    (?:{groups}): )\[[0-9][0-9, ]*\]"
    text = re.sub(line, rf"\g<1>{first}", (ROOT / "params.yaml").read_text())
    (params_copy / "params.yaml").write_text(text)
    p = load_params(params_copy / "params.yaml")
    assert p.grammar.instances == p.arithmetic.instances == FIRST and p.grammar.allocation["same_beta"] == FIRST
    return params_copy


@pytest.fixture(autouse=True)
def pushes(monkeypatch) -> list[str]:
    """What settle asked of the travelling DVC remote (pipelines/store.py), in order; nothing reaches DVC."""
    calls: list[str] = []
    monkeypatch.setattr(settle.store, "sync", lambda command: calls.append(command) or 0)
    return calls


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


def test_extend_appends_the_next_batch_to_the_instances_and_the_open_groups_and_keeps_comments(repo):
    before = (repo / "params.yaml").read_text()
    assert settle.extend("grammar", ["frontier", "camps"], repo / "params.yaml") == [128, 129, 130, 131]
    after = (repo / "params.yaml").read_text()
    p = load_params(repo / "params.yaml")
    assert p.grammar.instances == [*FIRST, 128, 129, 130, 131]
    assert p.grammar.allocation["frontier"] == p.grammar.allocation["camps"] == [*FIRST, 128, 129, 130, 131]
    assert p.grammar.allocation["same_beta"] == FIRST and p.grammar.allocation["checks"] == []  # closed groups stop
    assert p.arithmetic.instances == FIRST and p.arithmetic.allocation["frontier"] == FIRST  # the other task
    assert "# EVALUATION task seeds" in after and "# params.yaml: the one file to edit" in after
    # nothing but grammar's instances and those two groups' allocations changed: every other line is the same
    changed = [a for a, b in zip(after.splitlines(), before.splitlines()) if a != b]
    assert len(after.splitlines()) == len(before.splitlines()) and len(changed) == 3
    assert changed[0].startswith("  instances: [124") and changed[1].startswith("    frontier: [124")
    assert settle.extend("grammar", [], repo / "params.yaml") == [132, 133, 134, 135]  # the shared cells alone
    assert load_params(repo / "params.yaml").grammar.allocation["frontier"][-1] == 131
    assert sorted(p.name for p in repo.iterdir()) == ["params.yaml"]  # no temporary file left


@pytest.mark.parametrize("which", ["calibration", "planning"])
def test_extend_refuses_a_calibration_or_planning_seed_and_writes_nothing(repo, which):
    text = (repo / "params.yaml").read_text()
    key = "    instances: [0, 1, 2]  #" if which == "calibration" else "    plan_instances: [3, 4, 5,"
    new = "    instances: [0, 1, 130]  #" if which == "calibration" else "    plan_instances: [130, 4, 5,"
    assert key in text
    (repo / "params.yaml").write_text(text.replace(key, new, 1))
    text = (repo / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"^grammar: the next evaluation seeds \[130\] are calibration or planning"):
        settle.extend("grammar", ["same_beta"], repo / "params.yaml")
    assert (repo / "params.yaml").read_text() == text


def test_extend_past_the_max_cap_is_refused_by_validation_and_writes_nothing(repo):
    text = (repo / "params.yaml").read_text()
    assert "max_cap: 64 " in text
    (repo / "params.yaml").write_text(text.replace("max_cap: 64 ", "max_cap: 4 ", 1))
    text = (repo / "params.yaml").read_text()
    with pytest.raises(ParamsError, match=r"with grammar batch \[128, 129, 130, 131\].*at most the max cap \(4\)"):
        settle.extend("grammar", ["same_beta"], repo / "params.yaml")
    assert (repo / "params.yaml").read_text() == text


def test_open_comparisons_reads_the_status_of_each_primary_comparison(tmp_path):
    reports = tmp_path / "reports"
    assert settle.open_comparisons("grammar", reports) == []  # no report yet
    write_stats(tmp_path, "grammar", {"same_beta": "settled", "frontier_level1": "open",
                                      "frontier_level2": "unsettled at cap", "frontier_level3": CLOSED,
                                      "camps": "open"})  # fmt: skip
    assert settle.open_comparisons("grammar", reports) == ["frontier_level1", "camps"]  # amendment 1: closed stops
    assert settle.open_comparisons("arithmetic", reports) == []
    write_stats(tmp_path, "grammar", {"same_beta": "settled"})
    assert settle.open_comparisons("grammar", reports) == []


@pytest.mark.parametrize(
    "open_, groups",
    [
        (["same_beta"], ["same_beta"]),
        (["same_gradient"], ["same_gradient"]),  # its other side, reward_k1-act, is shared: on every instance
        (["frontier_level2"], ["frontier", "frontier_reward"]),
        (["kl_vs_none_level1", "kl_vs_none_level3"], ["frontier_reward"]),  # the no-KL trajectory is the baseline
        (["camps", "same_beta"], ["same_beta", "camps"]),  # in grid.design's order
        ([], []),
    ],
)
def test_open_groups_are_the_design_groups_an_open_comparison_reads(open_, groups):
    """Per-question allocation: the next batch goes to the groups whose cells an open comparison reads, never to a
    settled comparison's own cells (shared cells run on every instance anyway)."""
    assert settle.open_groups(load_params(ROOT / "params.yaml"), "grammar", open_) == groups


class FakeRunner:
    """Stands in for `python -m pipelines.run`: records its arguments, each task's instances and allocation, and
    writes each task's stats.json, with every primary comparison open until its groups have ``settled_at[task]``
    instances (a task it does not name: settled at its first batch), ``same_beta`` settled at the first batch."""

    def __init__(self, settled_at: dict[str, int], rc: int = 0):
        self.settled_at, self.rc, self.calls = settled_at, rc, []

    def __call__(self, cmd: list[str], **popen) -> int:
        from ablations.comparisons import primary_comparisons

        assert cmd[:3] == [sys.executable, "-m", "pipelines.run"]
        p = load_params()
        self.calls.append((cmd[3:], {t: (list(s.instances), dict(s.allocation)) for t, s in p.tasks().items()}))
        group_of = {(arm, role): g for g, arm, role in p.grid.design_cells()}
        for task, section in p.tasks().items():
            statuses = {}
            for c in primary_comparisons(p.analysis, len(section.calibration.levels)):
                n = min(len(section.allocation.get(group_of[cell], section.instances)) for cell in c.cells())
                need = 4 if c.name == "same_beta" else self.settled_at.get(task, 4)
                statuses[c.name] = "settled" if n >= need else "open"
            write_stats(Path("."), task, statuses)
        return self.rc


def test_settle_adds_batches_to_the_open_groups_until_settled(repo, monkeypatch, capsys, pushes):
    fake = FakeRunner({"grammar": 12, "arithmetic": 4})
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main(["--", "--workers", "2"]) == 0
    assert [args for args, _ in fake.calls] == [["--workers", "2"]] * 3  # the runner's arguments passed on
    assert pushes == ["push"] * 3  # each look's outputs to dvc-remote/, before its batch is decided
    assert [seen["grammar"][0][-1] for _, seen in fake.calls] == [127, 131, 135]  # a batch of 4 before each rerun
    assert all(seen["arithmetic"][0] == FIRST for _, seen in fake.calls)  # settled: never extended
    p = load_params()
    assert p.grammar.instances == list(range(124, 136))
    assert p.grammar.allocation["same_beta"] == FIRST  # settled at the first look: its cells stopped there
    for g in ("same_gradient", "frontier", "frontier_reward", "camps"):
        assert p.grammar.allocation[g] == list(range(124, 136)), g
    assert p.grammar.allocation["checks"] == []
    out = capsys.readouterr().out
    groups = "same_gradient, frontier, frontier_reward, camps"
    assert "settle: grammar: open same_gradient, frontier_level1, " in out
    assert f": instances [128, 129, 130, 131] for groups {groups}" in out
    assert f": instances [132, 133, 134, 135] for groups {groups}" in out
    assert "settle: grammar: same_beta material difference (settled, n = 4); same_gradient material" in out
    assert "settle: arithmetic: open" not in out


def test_settle_stops_after_the_given_number_of_batches(repo, monkeypatch, capsys):
    fake = FakeRunner({"grammar": 100, "arithmetic": 100})  # never settled
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main(["--batches", "1"]) == 0
    assert len(fake.calls) == 2  # run, one batch per task, run (its results read), stop
    assert load_params().grammar.instances == load_params().arithmetic.instances == list(range(124, 132))
    assert "settle: arithmetic: same_beta material difference (settled, n = 4); same_gradient inconclusive (open" in (
        capsys.readouterr().out
    )


def test_a_failing_run_stops_settle_with_its_exit_status_and_adds_nothing(repo, monkeypatch, pushes):
    text = (repo / "params.yaml").read_text()
    fake = FakeRunner({"grammar": 100, "arithmetic": 100}, rc=3)
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main([]) == 3
    assert len(fake.calls) == 1 and (repo / "params.yaml").read_text() == text
    assert pushes == []  # a failed run's stages were not recorded: nothing new to push


def test_settle_stops_in_one_line_when_the_next_batch_is_refused(repo, monkeypatch, capsys):
    text = (
        (repo / "params.yaml")
        .read_text()
        .replace("instances: [0, 1, 2]  # calibration task seeds (every", "instances: [0, 1, 129]  # (every", 1)
    )
    (repo / "params.yaml").write_text(text)
    fake = FakeRunner({"grammar": 100, "arithmetic": 4})
    monkeypatch.setattr(settle.subprocess, "call", fake)
    assert settle.main([]) == 2
    err = capsys.readouterr().err
    assert err == "error: grammar: the next evaluation seeds [129] are calibration or planning instances\n", err
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

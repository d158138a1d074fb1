"""Progress lines in a job's output: the parser, the tracker that reads the output as
it is shipped, its rate limit (clocks passed in, no sleeping), and the agent sending
``job.progress`` frames through the spool."""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING, Any

import pytest
from agent_helpers import Portal, await_until, launch_data, make_agent, running

from agents import protocol
from agents.launcher import Job
from agents.progress import (
    INTERVAL_S,
    MAX_LINE_CHARS,
    MAX_VALUE,
    MalformedProgressError,
    ProgressTracker,
    Reading,
    parse_line,
)
from agents.spool import Spool

if TYPE_CHECKING:
    from pathlib import Path

# ------------------------------------------------------------------ parse_line


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("GPULAB_PROGRESS 0", (0, None)),
        ("GPULAB_PROGRESS 1200", (1200, None)),
        ("GPULAB_PROGRESS 1200/5000", (1200, 5000)),
        ("GPULAB_PROGRESS 7/0", (7, 0)),
        ("GPULAB_PROGRESS 12/10", (12, 10)),  # past the total: kept as said
        ("GPULAB_PROGRESS 007/010", (7, 10)),
        ("GPULAB_PROGRESS 5\n", (5, None)),
        ("GPULAB_PROGRESS 5\r\n", (5, None)),
        ("  GPULAB_PROGRESS\t5/9  ", (5, 9)),
        ("GPULAB_PROGRESS   5", (5, None)),
        (f"GPULAB_PROGRESS {MAX_VALUE}/{MAX_VALUE}", (MAX_VALUE, MAX_VALUE)),
    ],
)
def test_it_reads_a_progress_line(line: str, expected: tuple[int, int | None]) -> None:
    assert parse_line(line) == expected


@pytest.mark.parametrize(
    "line",
    [
        "",
        "epoch 3 loss 0.25",
        "step 5/10",
        "gpulab_progress 5",  # the word is upper case
        "[rank0] GPULAB_PROGRESS 5",  # not at the start of the line
        "GPULAB_PROGRESS_BAR 5",  # another word
        "GPULAB_PROGRESS2 5",
    ],
)
def test_it_leaves_other_lines_alone(line: str) -> None:
    assert parse_line(line) is None


@pytest.mark.parametrize(
    "line",
    [
        "GPULAB_PROGRESS",
        "GPULAB_PROGRESS ",
        "GPULAB_PROGRESS x",
        "GPULAB_PROGRESS -5",
        "GPULAB_PROGRESS +5",
        "GPULAB_PROGRESS 5.5",
        "GPULAB_PROGRESS 1e3",
        "GPULAB_PROGRESS 1_000",
        "GPULAB_PROGRESS 1,000",
        "GPULAB_PROGRESS \u0661\u0662",  # Arabic-Indic digits: int() takes them
        "GPULAB_PROGRESS 5/",
        "GPULAB_PROGRESS /5",
        "GPULAB_PROGRESS 5 / 10",
        "GPULAB_PROGRESS 5/10/20",
        "GPULAB_PROGRESS 5 loss=0.3",
        "GPULAB_PROGRESS 5 10",
        "GPULAB_PROGRESS:5",
        "GPULAB_PROGRESS=5",
        f"GPULAB_PROGRESS {MAX_VALUE + 1}",
        f"GPULAB_PROGRESS 1/{MAX_VALUE + 1}",
        "GPULAB_PROGRESS " + "9" * 20,
        "GPULAB_PROGRESS " + "9" * 5000,  # more digits than int() takes
    ],
)
def test_it_refuses_a_malformed_progress_line(line: str) -> None:
    with pytest.raises(MalformedProgressError):
        parse_line(line)


# ------------------------------------------------------------------ the tracker


def test_it_keeps_the_latest_step_across_chunks_and_line_ends() -> None:
    tracker = ProgressTracker()

    tracker.feed("loading\nGPULAB_PROGRESS 1/10\nGPULAB_PRO", at=100.0)
    assert tracker.latest == Reading(1, 10, 100.0)
    tracker.feed("GRESS 2/10", at=101.0)  # no line break yet: not complete
    assert tracker.latest == Reading(1, 10, 100.0)
    tracker.feed("\r\nGPULAB_PROGRESS 3/10\rGPULAB_PROGRESS 4\n", at=102.0)

    assert tracker.latest == Reading(4, None, 102.0)


def test_it_counts_a_last_line_without_a_line_break_when_the_job_ends() -> None:
    tracker = ProgressTracker()
    tracker.feed("GPULAB_PROGRESS 1\nGPULAB_PROGRESS 2", at=1.0)

    tracker.finish(at=2.0)

    assert tracker.latest == Reading(2, None, 2.0)


def test_it_skips_an_over_long_line_without_keeping_it() -> None:
    tracker = ProgressTracker()

    tracker.feed("x" * (MAX_LINE_CHARS + 1), at=1.0)
    tracker.feed("GPULAB_PROGRESS 9\n", at=2.0)  # the end of the long line
    assert tracker.latest is None
    tracker.feed("GPULAB_PROGRESS 3\n", at=3.0)

    assert tracker.latest == Reading(3, None, 3.0)


def test_it_returns_the_first_malformed_line_once() -> None:
    tracker = ProgressTracker()

    first = tracker.feed("GPULAB_PROGRESS five\nGPULAB_PROGRESS 4\n", at=1.0)
    second = tracker.feed("GPULAB_PROGRESS six\n", at=2.0)

    assert first == "GPULAB_PROGRESS five"
    assert second is None
    assert tracker.latest == Reading(4, None, 1.0)


def test_it_sends_at_most_one_reading_per_interval_the_latest_winning() -> None:
    tracker = ProgressTracker()
    sent: list[tuple[float, int]] = []

    def tick(now: float, step: int | None = None) -> None:
        if step is not None:
            tracker.feed(f"GPULAB_PROGRESS {step}\n", at=1000.0 + now)
        reading = tracker.take(now)
        if reading is not None:
            sent.append((now, reading.step))

    tick(0.0)  # nothing reported yet
    tick(0.5, 1)  # the first report goes at once
    tick(1.0, 2)
    tick(5.0, 3)
    tick(INTERVAL_S + 0.4, 4)  # 9.9 s after the last send: held back
    tick(INTERVAL_S + 0.5)  # 10 s: the latest goes
    tick(INTERVAL_S + 1.0)  # nothing new
    tick(3 * INTERVAL_S)  # still nothing new: no repeat
    tick(3 * INTERVAL_S + 1, 5)  # quiet for a while: at once

    assert sent == [(0.5, 1), (INTERVAL_S + 0.5, 4), (3 * INTERVAL_S + 1, 5)]


def test_the_final_take_sends_what_is_new_whatever_the_interval() -> None:
    tracker = ProgressTracker()
    tracker.feed("GPULAB_PROGRESS 1\n", at=1.0)
    assert tracker.take(0.0) is not None
    tracker.feed("GPULAB_PROGRESS 2\n", at=2.0)

    assert tracker.take(1.0) is None
    assert tracker.take(1.0, final=True) == Reading(2, None, 2.0)
    assert tracker.take(1.0, final=True) is None  # already sent


# ------------------------------------------------------------------ the agent


def spooled(agent: Any, type_: str) -> list[dict[str, Any]]:
    return [
        msg
        for _, frame in agent.spool.pending()
        if (msg := json.loads(frame))["type"] == type_
    ]


def test_the_reaper_spools_progress_as_droppable_and_warns_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    agent = make_agent("ws://127.0.0.1:9", tmp_path / "state")
    job_dir = tmp_path / "state/jobs/3"
    job_dir.mkdir(parents=True)
    (job_dir / "started").write_text("1.0\n")
    out = job_dir / "output.log"
    out.write_text("GPULAB_PROGRESS 1/10\nGPULAB_PROGRESS x\nGPULAB_PROGRESS y\n")
    job = Job(3, 1003, job_dir, [], {})

    with caplog.at_level(logging.WARNING, logger="agents.reaper"):
        agent._ship_log(job, final=False)
        agent._send_progress(job, now=0.0)
        with out.open("a") as fh:
            fh.write("GPULAB_PROGRESS 2/10\nGPULAB_PROGRESS z\nGPULAB_PROGRESS 3/10")
        agent._ship_log(job, final=False)
        agent._send_progress(job, now=1.0)  # within the interval: held back
        assert len(spooled(agent, "job.progress")) == 1
        agent._ship_log(job, final=True)
        agent._send_progress(job, now=2.0, final=True)

    progress = spooled(agent, "job.progress")
    assert [(m["data"]["step"], m["data"]["total"]) for m in progress] == [
        (1, 10),
        (3, 10),
    ]
    assert progress[0]["data"]["attempt_id"] == 3
    assert progress[0]["data"]["job_id"] == 1003
    # Droppable like metric samples, also once the spool is read back.
    assert all(m["seq"] in agent.spool.droppable for m in progress)
    again = Spool(agent.spool.path)
    assert [m["seq"] for m in progress] == list(again.droppable)
    warnings = [
        r.getMessage() for r in caplog.records if "GPULAB_PROGRESS" in r.message
    ]
    assert len(warnings) == 1
    assert "'GPULAB_PROGRESS x'" in warnings[0]
    assert "attempt 3" in warnings[0]


@pytest.mark.anyio
async def test_a_job_printing_progress_sends_it_before_its_exit(
    portal: Portal, tmp_path: Path
) -> None:
    agent = make_agent(portal.url, tmp_path / "state")
    command = (
        "echo GPULAB_PROGRESS 1/4; echo not progress;"
        " echo GPULAB_PROGRESS 3/4 >&2; printf 'GPULAB_PROGRESS 4/4'"
    )
    async with running(agent):
        await await_until(lambda: portal.of("hello"))
        await portal.send("job.launch", launch_data(21, command, tmp_path))
        exited = (await await_until(lambda: portal.of("job.exited", attempt_id=21)))[0]

    progress = portal.of("job.progress", attempt_id=21)
    assert progress, "no job.progress frame"
    assert progress[-1]["data"]["step"] == 4
    assert progress[-1]["data"]["total"] == 4
    assert progress[-1]["seq"] < exited["seq"]
    assert len(progress) <= 2  # the first report, then the final one
    protocol.JobProgressData.model_validate(progress[-1]["data"])

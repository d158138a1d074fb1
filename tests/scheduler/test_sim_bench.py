"""``bench/sim_report.py``'s yardstick and accounting lines and
``bench/tiresias_sweep.py``'s option checks (pure, no replay)."""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench

report = load_bench("sim_report")
sweep = load_bench("tiresias_sweep")


@pytest.mark.parametrize(
    ("tiresias", "verdict"), [(3600.0, "holds"), (7200.0, "FAILS")]
)
def test_the_yardstick_line_compares_free_tiresias_with_slurm(tiresias, verdict):
    got = report.yardstick_lines(
        {"slurm": {"avg_jct_s": 7200.0}, "tiresias-free": {"avg_jct_s": tiresias}}
    )
    assert len(got) == 1 and got[0].endswith(f"{verdict}.")
    assert report.yardstick_lines({"slurm": {"avg_jct_s": 7200.0}}) == []


def test_the_accounting_line_names_every_part():
    r = {
        "accounted": {
            "trace_rows": 10,
            "outside_case": {"other_vc": 4},
            "skipped": {"more_gpus_than_cluster": 1},
            "completed": 4,
            "timed_out": 1,
            "unfinished": 0,
        },
        "avg_jct_over": {"jobs": 5},
    }
    [head, _, line, _] = report.accounting_lines({"fifo": r})
    assert head == "Accounting:"
    assert line == (
        "- `fifo`: 10 rows = other_vc 4 outside the case + skipped"
        " (more_gpus_than_cluster 1) + 4 completed + 1 timed out + 0 unfinished;"
        " averages over the 5 finished jobs"
    )


def test_tiresias_variants_run_the_policy_with_every_job_checkpointable():
    policy, extra = report.VARIANTS["tiresias-free"]
    assert policy == "tiresias"
    assert extra == (
        "--checkpointable-fraction", "1", "--checkpoint-interval", "0",
        "--restart-overhead", "0",
    )  # fmt: skip
    assert report.VARIANTS["tiresias"] == (
        "tiresias",
        ("--checkpointable-fraction", "1"),
    )


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--grid", "1,x"], "--grid: not a list of numbers"),
        (["--grid", "0,4"], "--grid: give thresholds > 0"),
        (["--costs", "cheap"], "--costs: choose from free, default"),
    ],
)
def test_the_sweep_names_bad_options(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        sweep.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

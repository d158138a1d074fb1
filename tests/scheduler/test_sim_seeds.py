"""``bench/sim_seeds.py``: the policies over several seeds, and their ratios."""

from __future__ import annotations

import json
import math

import pytest

from tests.bench_scripts import load_bench

seeds_bench = load_bench("sim_seeds")


@pytest.mark.parametrize(
    ("text", "seeds"),
    [("0-4", [0, 1, 2, 3, 4]), ("0,2,7", [0, 2, 7]), ("0-2,9,1", [0, 1, 2, 9])],
)
def test_seeds_are_ranges_or_lists(text, seeds):
    assert seeds_bench.parse_seeds(text) == seeds


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("x", "'x' is not a seed or a range"),
        ("3-1", "'3-1' is not a range of seeds >= 0"),
        ("-1", "'-1' is not a seed or a range"),
        (",", "no seed given"),
    ],
)
def test_bad_seeds_are_named(text, message):
    with pytest.raises(ValueError, match=message):
        seeds_bench.parse_seeds(text)


def result(avg, p99, sizes=None):
    return {"avg_jct_s": avg, "p99_jct_s": p99, "jct_by_size": sizes or {}}


def test_ratios_are_summarised_per_seed_against_the_baseline():
    runs = {
        ("slurm", 0): result(100.0, 1000.0, {"1": 10.0, "2-4": None}),
        ("gpulab", 0): result(90.0, 1100.0, {"1": 8.0, "2-4": 5.0}),
        ("slurm", 1): result(200.0, 1000.0, {"1": 10.0}),
        ("gpulab", 1): result(190.0, 800.0, {"1": 12.0}),
        ("slurm", 2): result(50.0, 500.0),  # gpulab's run failed: left out
    }
    got = seeds_bench.compare(runs, ["slurm", "gpulab"], "slurm", [0, 1, 2])
    assert set(got) == {"gpulab"}
    avg = got["gpulab"]["avg_jct_s"]
    assert avg["n"] == 2
    assert avg["mean"] == pytest.approx((-0.10 - 0.05) / 2)
    assert avg["worst"] == pytest.approx(-0.05)
    assert avg["better"] == 2
    assert avg["se"] == pytest.approx(abs(-0.10 + 0.05) / 2)  # stdev / sqrt(2)
    p99 = got["gpulab"]["p99_jct_s"]
    assert (p99["mean"], p99["worst"], p99["better"]) == (
        pytest.approx(-0.05),
        pytest.approx(0.10),
        1,
    )
    # a size class the baseline lacks on a seed counts on the other seeds only
    assert got["gpulab"]["size:1"]["n"] == 2
    assert got["gpulab"]["size:2-4"] == {
        "n": 0, "mean": None, "se": None, "worst": None, "better": 0
    }  # fmt: skip


def waits(**by_job):
    return {"queue_s_by_job": {k.lstrip("j"): v for k, v in by_job.items()}}


def test_wait_ratios_are_per_job_over_the_jobs_that_waited_over_an_hour():
    h = 3600.0
    runs = {
        # seed 0: j1 and j2 waited over 1 h under slurm; j3 exactly 1 h (left out)
        ("slurm", 0): waits(j1=2 * h, j2=4 * h, j3=h, j4=0.0),
        ("gpulab", 0): waits(j1=h, j2=12 * h, j3=50 * h, j4=9 * h),
        # seed 1: j1 over 1 h under slurm never finished under gpulab
        ("slurm", 1): waits(j1=10 * h, j2=5 * h),
        ("gpulab", 1): waits(j2=0.0),
        # seed 2: an old replay without per-job waits: left out
        ("slurm", 2): {},
        ("gpulab", 2): waits(j1=h),
    }
    got = seeds_bench.wait_ratios(runs, "gpulab", "slurm", [0, 1, 2])
    assert got["waited_over_s"] == h
    assert set(got["by_seed"]) == {"0", "1"}
    s0 = got["by_seed"]["0"]
    assert (s0["jobs"], s0["unfinished"]) == (2, 0)
    assert s0["p50"] == pytest.approx((0.5 + 3.0) / 2)
    assert s0["max"] == pytest.approx(3.0)
    assert s0["p99"] == pytest.approx(0.5 + 2.5 * 0.99)
    s1 = got["by_seed"]["1"]
    assert (s1["jobs"], s1["unfinished"], s1["max"]) == (1, 1, 0.0)
    pooled = got["all"]
    assert (pooled["jobs"], pooled["unfinished"]) == (3, 1)
    assert pooled["p50"] == pytest.approx(0.5)
    assert pooled["max"] == pytest.approx(3.0)
    assert seeds_bench.wait_ratios(runs, "gpulab", "slurm", [2]) is None
    table = "\n".join(seeds_bench.wait_markdown("gpulab", "slurm", got))
    assert "| 0 | 2 | 1.75 | 2.98 | 3.00 | 0 |" in table
    assert "| all | 3 | 0.50 | 2.95 | 3.00 | 1 |" in table


def test_user_ratios_say_who_is_better_and_who_is_worse_off_user_by_user():
    def users(**means):
        return {"user_slowdown": {f"g/{u}": [3, m] for u, m in means.items()}}

    runs = {
        # u1 better, u2 5 % worse (not counted worse), u3 50 % worse; u4 only
        # under slurm is not compared
        ("slurm", 0): users(u1=4.0, u2=2.0, u3=1.0, u4=9.0),
        ("gpulab", 0): users(u1=2.0, u2=2.1, u3=1.5),
        # seed 1: no per-user means (an old replay): left out
        ("slurm", 1): {},
        ("gpulab", 1): users(u1=1.0),
    }
    got = seeds_bench.user_ratios(runs, "gpulab", "slurm", [0, 1])
    assert set(got) == {"0"}
    s0 = got["0"]
    assert (s0["users"], s0["better"], s0["worse"]) == (3, 1, 1)
    assert (s0["largest_user"], s0["largest_ratio"]) == ("g/u3", pytest.approx(1.5))
    # the worst user's mean is the largest under each, whoever it is
    assert (s0["worst_mean"], s0["baseline_worst_mean"]) == (2.1, 9.0)
    table = "\n".join(seeds_bench.user_markdown("gpulab", "slurm", got))
    assert "| 0 | 3 | 1 | 1 | 1.50 (g/u3) | 2.1 / 9.0 |" in table
    assert "worse by > 10 %" in table


def test_it_replays_each_policy_on_each_seed_and_writes_the_table(tmp_path, capsys):
    code = seeds_bench.main(
        ["--only", "b", "--seeds", "0-1", "--max-jobs", "400",
         "--out-dir", str(tmp_path), "--parallel", "2"]
    )  # fmt: skip
    assert code == 0
    runs = {}
    for policy in ("slurm", "gpulab"):
        for seed in (0, 1):
            data = json.loads((tmp_path / f"seeds_b_{policy}_{seed}.json").read_text())
            assert (data["policy"], data["seed"]) == (policy, seed)
            runs[policy, seed] = data
    # the seed changes the replay (users, limits) and the policies differ on it
    assert runs["slurm", 0]["avg_jct_s"] != runs["slurm", 1]["avg_jct_s"]
    assert runs["gpulab", 0]["avg_jct_s"] != runs["slurm", 0]["avg_jct_s"]
    table = (tmp_path / "sim_seeds.md").read_text()
    assert table.strip() in capsys.readouterr().out
    for seed in (0, 1):
        r = runs["gpulab", seed]["p99_jct_s"] / runs["slurm", seed]["p99_jct_s"] - 1
        assert f" {100 * r:+.1f} % |" in table.split(f"\n| {seed} | ")[1].split("\n")[0]
    mean = (
        sum(
            runs["gpulab", s]["avg_jct_s"] / runs["slurm", s]["avg_jct_s"] - 1
            for s in (0, 1)
        )
        / 2
    )
    assert math.isfinite(mean)
    assert f"| avg JCT | 2 | {100 * mean:+.1f} % |" in table
    # the wait ratios, from the replays' per-job waits, in the table and the JSON
    summary = json.loads((tmp_path / "sim_seeds.json").read_text())["b"]
    assert summary["ratios"]["gpulab"]["avg_jct_s"]["mean"] == pytest.approx(mean)
    w = summary["wait_ratios"]["gpulab"]
    expect = seeds_bench.wait_ratios(runs, "gpulab", "slurm", [0, 1])
    assert w == json.loads(json.dumps(expect))
    over = [
        runs["gpulab", 0]["queue_s_by_job"][k] / v
        for k, v in runs["slurm", 0]["queue_s_by_job"].items()
        if v > 3600
    ]
    assert w["by_seed"]["0"]["jobs"] == len(over) > 0
    assert w["by_seed"]["0"]["max"] == pytest.approx(max(over))
    assert "Per-job waits, `gpulab` / `slurm`" in table
    assert summary["user_ratios"]["gpulab"] == json.loads(
        json.dumps(seeds_bench.user_ratios(runs, "gpulab", "slurm", [0, 1]))
    )
    assert summary["user_ratios"]["gpulab"]["0"]["users"] > 0
    assert "Per user, mean bounded slowdown under `gpulab`" in table


def test_an_unknown_scenario_or_a_missing_baseline_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        seeds_bench.main(["--only", "colo-z"])
    assert exc.value.code == 2
    assert "unknown scenario 'colo-z'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        seeds_bench.main(["--policies", "gpulab", "--baseline", "slurm"])
    assert "--baseline 'slurm' is not one of --policies" in capsys.readouterr().err


def test_the_share_of_the_oracles_gain_is_summed_over_seeds_with_its_error():
    h = 3600.0
    runs = {
        ("gpulab-exclusive", 0): result(10 * h, 0), ("oracle", 0): result(6 * h, 0),
        ("gpulab", 0): result(8 * h, 0),  # 2 h of the oracle's 4 h
        ("gpulab-exclusive", 1): result(10 * h, 0), ("oracle", 1): result(9 * h, 0),
        ("gpulab", 1): result(8.5 * h, 0),  # 1.5 h of 1 h: over the oracle
        ("gpulab-exclusive", 2): result(10 * h, 0),  # no oracle: left out
        ("gpulab", 2): result(1 * h, 0),
    }  # fmt: skip
    got = seeds_bench.colo_share(runs, "gpulab", [0, 1, 2])
    assert got is not None
    assert (got["seeds"], got["gain_h"], got["oracle_gain_h"]) == (2, 3.5, 5.0)
    assert got["share"] == pytest.approx(0.7)
    assert got["by_seed"] == {"0": pytest.approx(0.5), "1": pytest.approx(1.5)}
    # ratio estimator: sqrt(2 * ((2 - 0.7 * 4)^2 + (1.5 - 0.7 * 1)^2)) / 5 h
    assert got["se"] == pytest.approx(math.sqrt(2 * (0.8**2 + 0.8**2)) / 5)
    # one seed: no error; an oracle that gains nothing: no share
    assert seeds_bench.colo_share(runs, "gpulab", [0])["se"] is None
    flat = {**runs, ("oracle", 0): result(10 * h, 0)}
    assert seeds_bench.colo_share(flat, "gpulab", [0]) is None


def test_a_colocation_scenario_reports_its_goals_and_the_oracles_share(tmp_path):
    code = seeds_bench.main(
        ["--only", "colo-b", "--seeds", "0-1", "--max-jobs", "300", "--policies",
         "gpulab-exclusive,gpulab,oracle", "--baseline", "gpulab-exclusive",
         "--out-dir", str(tmp_path), "--parallel", "2"]
    )  # fmt: skip
    assert code == 0
    runs = {
        (pol, seed): json.loads(
            (tmp_path / f"seeds_colo-b_{pol}_{seed}.json").read_text()
        )
        for pol in ("gpulab-exclusive", "gpulab", "oracle")
        for seed in (0, 1)
    }
    table = (tmp_path / "sim_seeds.md").read_text()
    assert "Co-location over the seeds" in table
    row = table.split("\n| `gpulab` | 2 | ")[1].split("\n")[0]
    trials = [runs["gpulab", s]["exploration_trials"] for s in (0, 1)]
    assert row.startswith(f"{min(trials)}-{max(trials)} ({sum(trials)}) |")
    summary = json.loads((tmp_path / "sim_seeds.json").read_text())["colo-b"]
    share = summary["colo_share"]["gpulab"]
    expect = seeds_bench.colo_share(runs, "gpulab", [0, 1])
    # on its first 300 jobs the oracle shares and gains a few minutes a job
    assert expect is not None and expect["oracle_gain_h"] > 0
    assert share == json.loads(json.dumps(expect))
    assert f"{100 * expect['share']:.0f} % +- " in row
    assert sum(runs["oracle", s]["admitted_pairs"] for s in (0, 1)) > 0


def test_a_checkpointable_fraction_reaches_every_replay_and_the_table(tmp_path):
    code = seeds_bench.main(
        ["--only", "b", "--seeds", "0", "--max-jobs", "300", "--policies",
         "slurm,gpulab", "--checkpointable-fraction", "0.5",
         "--out-dir", str(tmp_path), "--parallel", "1"]
    )  # fmt: skip
    assert code == 0
    for policy in ("slurm", "gpulab"):
        data = json.loads((tmp_path / f"seeds_b_{policy}_0.json").read_text())
        assert data["options"]["checkpointable_fraction"] == 0.5
        assert 0 < data["checkpointable_jobs"] < 300
        assert data["preemption_lost_share"] >= 0.0
    table = (tmp_path / "sim_seeds.md").read_text()
    assert "`--checkpointable-fraction 0.5`" in table
    assert "Work lost to preemption" in table and "`slurm` 0.0 GPU-h" in table


def test_a_checkpointable_fraction_out_of_range_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        seeds_bench.main(["--checkpointable-fraction", "1.5"])
    assert exc.value.code == 2
    assert "--checkpointable-fraction must be in [0, 1], not 1.5" in (
        capsys.readouterr().err
    )


def test_a_max_wait_reaches_every_replay_and_the_table_shows_the_longest_wait(
    tmp_path,
):
    code = seeds_bench.main(
        ["--only", "b", "--seeds", "0", "--max-jobs", "300", "--policies",
         "slurm,gpulab", "--max-wait", "7200", "--out-dir", str(tmp_path),
         "--parallel", "1"]
    )  # fmt: skip
    assert code == 0
    table = (tmp_path / "sim_seeds.md").read_text()
    assert "`--max-wait 7200`" in table
    assert "gpulab max wait (h)" in table
    row = table.split("\n| 0 | ")[1].split("\n")[0]
    for policy in ("slurm", "gpulab"):
        data = json.loads((tmp_path / f"seeds_b_{policy}_0.json").read_text())
        assert data["options"]["max_wait_s"] == 7200.0
        longest = max(data["queue_s_by_job"].values())
        assert data["max_queue_s"] == pytest.approx(longest)
        assert f" {longest / 3600:.2f} |" in row


def test_a_negative_max_wait_is_refused(capsys):
    with pytest.raises(SystemExit) as exc:
        seeds_bench.main(["--max-wait", "-1"])
    assert exc.value.code == 2
    assert "--max-wait must be 0 or more seconds, not -1" in capsys.readouterr().err


def test_a_variant_is_a_policy_run_with_options(tmp_path):
    code = seeds_bench.main(
        ["--only", "b", "--seeds", "0", "--max-jobs", "200", "--policies",
         "slurm,gpulab-oracle", "--out-dir", str(tmp_path), "--parallel", "1",
         "--variant", "gpulab-oracle=gpulab --oracle-runtime --las-extra-plans 2"]
    )  # fmt: skip
    assert code == 0
    data = json.loads((tmp_path / "seeds_b_gpulab-oracle_0.json").read_text())
    assert data["policy"] == "gpulab"
    assert data["options"]["oracle_runtime"] is True
    assert data["options"]["las_extra_plans"] == 2
    assert "gpulab-oracle avg (h)" in (tmp_path / "sim_seeds.md").read_text()


@pytest.mark.parametrize(
    ("variant", "message"),
    [("gpulab --oracle-runtime", "is not LABEL=POLICY"), ("x=nope", "unknown policy")],
)
def test_a_bad_variant_is_named(capsys, variant, message):
    with pytest.raises(SystemExit) as exc:
        seeds_bench.main(["--variant", variant])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err

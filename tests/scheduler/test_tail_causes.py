"""``bench/tail_causes.py``: per-job records of a replay, and the comparison of two."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_scripts import load_bench

tail = load_bench("tail_causes")
report = load_bench("sim_report")


def record(tmp_path: Path, policy: str) -> tuple[dict, dict]:
    out = tmp_path / f"{policy}.json"
    argv = [*report.SCENARIOS["b"][1], "--policy", policy, "--max-jobs", "300",
            "--quiet", "--no-check", "--out", str(out)]  # fmt: skip
    assert tail.main(["record", *argv]) == 0
    return (
        json.loads(out.read_text()),
        json.loads(Path(f"{out}.jobs.json").read_text()),
    )


def test_records_match_the_replay_and_the_comparison_names_the_tail(tmp_path, capsys):
    result, rec = record(tmp_path, "slurm")
    _, rec_g = record(tmp_path, "gpulab")
    jobs = {str(j["id"]): j for j in rec["jobs"]}
    # one record per finished job, with the replay's own waits and JCTs
    assert jobs.keys() == result["queue_s_by_job"].keys()
    for k, q in result["queue_s_by_job"].items():
        assert jobs[k]["queue_s"] == q
    avg = sum(j["end"] - j["submit"] for j in jobs.values()) / len(jobs)
    assert abs(avg - result["avg_jct_s"]) < 1e-6 * avg
    # every start is a job's, at or after its submission; a first start is one
    started = {}
    for t, jid, _bf in rec["starts"]:
        started.setdefault(jid, t)
        assert t >= jobs[str(jid)]["submit"]
    for j in jobs.values():
        assert started[j["id"]] == j["first_start"]
        # a job that waited was seen by a pass: its waits are counted by reason
        if j["queue_s"] > 3600:
            assert sum(j["reasons"].values()) > 0
    assert sum(rec["top_h_by_size"].values()) > 0
    a, b = tmp_path / "slurm.json.jobs.json", tmp_path / "gpulab.json.jobs.json"
    capsys.readouterr()
    assert tail.main(["compare", str(a), str(b), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "p99 JCT: baseline" in out
    assert "2-4 GPUs: the 3 jobs whose JCT grew most" in out
    # the policy's tail not in the baseline's: each line names a job of both runs
    gone = {j["id"] for j in rec_g["jobs"]}
    for line in out.split("not the baseline's:")[1].split("\n\n")[0].splitlines()[1:]:
        assert int(line.split()[1]) in gone

"""The API fuzzed against its own OpenAPI schema, larger than the suite's run.

Runs ``tests/api/test_schema_fuzz.py`` (schemathesis: every check, the
examples, coverage, fuzzing and stateful phases (``--scenarios``), positive and negative data, as a member
and as staff, every phase for both, in process on real PostgreSQL and Redis)
with ``--examples`` fuzzed cases per operation and persona and a fixed
``--seed``, and reports what it sent and what failed: cases per phase, mode
and status, each failing operation with schemathesis' own words, and the wall
time with the machine's load. It exits non-zero only when it could not run;
failures are figures.

Run: ``python -m portal.stack.run -- python bench/schema_fuzz.py --examples 200``.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_stack import loadavg, machine  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument(
        "--scenarios", type=int, default=50, help="stateful scenarios per persona"
    )
    parser.add_argument("--out-dir", type=Path, default=None)
    parser.add_argument("-k", default=None, help="pytest -k: some operations only")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "cases.jsonl"
        junit = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "GPULAB_FUZZ_EXAMPLES": str(args.examples),
            "GPULAB_FUZZ_SEED": str(args.seed),
            "GPULAB_FUZZ_LOG": str(log),
            "GPULAB_FUZZ_FULL": "1",
            "GPULAB_FUZZ_SCENARIOS": str(args.scenarios),
        }
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-n",
            "0",
            "-q",
            "-p",
            "no:cacheprovider",
            f"--junitxml={junit}",
            "--timeout=0",  # a run as long as its cases take
            "tests/api/test_schema_fuzz.py",
        ]
        if args.k:
            cmd += ["-k", args.k]
        load_before = loadavg()
        started = time.monotonic()
        run = subprocess.run(
            cmd, cwd=ROOT, env=env, capture_output=True, text=True, check=False
        )
        wall = time.monotonic() - started
        if run.returncode not in (0, 1):
            sys.stdout.write(run.stdout[-5000:] + run.stderr[-5000:])
            return 2
        cases = [json.loads(line) for line in log.read_text().splitlines()]
        if args.out_dir is not None:
            args.out_dir.mkdir(parents=True, exist_ok=True)
            (args.out_dir / "schema_fuzz.log").write_text(run.stdout + run.stderr)
        report = _report(cases, run.stdout, wall, args, load_before)
    print(json.dumps(report, indent=2))
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / "schema_fuzz.json").write_text(json.dumps(report, indent=2))
    return 0


def _report(
    cases: list[dict[str, Any]],
    output: str,
    wall: float,
    args: argparse.Namespace,
    load_before: str,
) -> dict[str, Any]:
    def count(*keys: str) -> dict[str, int]:
        c = collections.Counter("/".join(str(x[k]) for k in keys) for x in cases)
        return dict(sorted(c.items()))

    failures = []
    for section in re.split(r"^_{3,} ", output, flags=re.M)[1:]:
        title = section.split(" _", 1)[0].strip()
        found = re.findall(r"^\s*\|?\s*- (ST\d+ [^\n]+)$", section, re.M)
        answers = re.findall(r"^\s*\|?\s*(\[\d{3}\] [^\n]*)$", section, re.M)
        bodies = re.findall(r"^\s*\|?\s*`(\{[^\n]*)`$", section, re.M)
        calls = re.findall(r"^\s*\|?\s*(curl [^\n]*)$", section, re.M)
        failures.append(
            {
                "test": title,
                "checks": sorted(set(found)),
                "answers": [a[:300] for a in answers[:3]],
                "bodies": [b[:300] for b in bodies[:3]],
                "calls": [c[:300] for c in calls[:3]],
            }
        )
    checks = collections.Counter(c for f in failures for c in f["checks"])
    summary = re.findall(r"^=*\s*(\d+ (?:passed|failed)[^\n]*?)\s*=*$", output, re.M)
    return {
        "examples_per_operation": args.examples,
        "seed": args.seed,
        "cases": len(cases),
        "by_persona": count("persona"),
        "by_phase_mode": count("phase", "mode"),
        "by_status": count("status"),
        "positive_400_beyond_schema": sum(1 for c in cases if c["beyond"]),
        "server_errors": sum(1 for c in cases if c["status"] >= 500),
        "failures": failures,
        "failed_checks": dict(checks),
        "pytest": summary[-1] if summary else output.strip().splitlines()[-1:],
        "wall_s": round(wall, 1),
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
    }


if __name__ == "__main__":
    raise SystemExit(main())

"""schemathesis' own runner against the real stack: every phase, every check.

Starts ``make up``'s processes (``real_stack``: uvicorn, worker, notifier,
beat, simulated agents) on a fresh database, makes a member (alice, group
vision, one job of her own) and a staff user with API tokens, and runs ``st
run`` against ``/api/v1/schema/`` once per persona with every phase this
schemathesis has (examples, coverage, fuzzing, stateful), every check
(``positive_data_acceptance`` through this module's
``positive_data_acceptance_beyond_schema``, which allows the suite's
``fuzz_rules.BEYOND_SCHEMA`` refusals; ``max_response_time`` at schemathesis'
10 s), positive and negative
data, a fixed ``--seed``, ``--examples`` per operation and ``--max-time`` per
persona. The stateful phase chains operations through the links schemathesis
infers from the schema and from responses (``Location`` headers, URLs in
bodies).

Prints, per persona, the operations and cases schemathesis reports, each
failure in its own words, and the wall time with the machine's load; exits 1
when any check failed or any error was reported, 2 when it could not run.

Run: ``python -m portal.stack.run -- python bench/schema_fuzz_stack.py``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import schemathesis
from schemathesis.specs.openapi.checks import positive_data_acceptance

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "bench"), str(ROOT)]
from real_stack import fresh_database, loadavg, machine, real_stack  # noqa: E402

from tests.api.fuzz_rules import beyond_schema  # noqa: E402

PHASES = ("examples", "coverage", "fuzzing", "stateful")
# Refusals: a body over GPULAB_API_MAX_BODY_BYTES is refused before it is read.
REJECTED = [
    *("400", "401", "403", "404", "405", "406", "409"),
    *("413", "415", "422", "428", "429"),
]
ACCEPTED = ["2xx", "401", "403", "404", "409", "429"]
# schemathesis' own limit for its max_response_time check (its default)
MAX_RESPONSE_S = 10.0


@schemathesis.check
def positive_data_acceptance_beyond_schema(
    ctx: Any, response: Any, case: Any
) -> bool | None:
    """schemathesis' ``positive_data_acceptance`` (with its configured expected
    statuses), except for a 400 naming only rules no schema can state
    (``tests/api/fuzz_rules.py``, the suite's exception too). ``st run`` loads
    this module as its hooks (``SCHEMATHESIS_HOOKS``) and runs this check in
    place of the built-in one, which the run disables."""
    if beyond_schema(response):
        return None
    result: bool | None = positive_data_acceptance(ctx, response, case)
    return result


def config_toml(args: argparse.Namespace) -> str:
    def phase(name: str) -> str:
        on = "true" if name in args.phases else "false"
        extra = f"max-steps = {args.max_steps}\n" if name == "stateful" else ""
        return f"[phases.{name}]\nenabled = {on}\n{extra}"

    return (
        f"seed = {args.seed}\n"
        f'[generation]\nmode = "all"\nmax-examples = {args.examples}\n'
        'database = "none"\n'
        + "".join(phase(p) for p in PHASES)
        + f"[checks.negative_data_rejection]\nexpected-statuses = {json.dumps(REJECTED)}\n"
        "[checks.positive_data_acceptance]\nenabled = false\n"
        f"expected-statuses = {json.dumps(ACCEPTED)}\n"
    )


def make_users() -> dict[str, str]:
    from django.contrib.auth.models import User

    from portal.api import tokens
    from scheduler.models import Group, Membership
    from tests.factories import JobFactory

    vision = Group.objects.create(name="vision")
    Group.objects.create(name="nlp")
    alice = User.objects.create_user("alice", "alice@lab.example", "pw-alice")
    Membership.objects.create(user=alice, group=vision)
    admin = User.objects.create_superuser("admin", "admin@lab.example", "pw-admin")
    JobFactory(owner=alice)
    return {
        "member": tokens.create_token(alice, "fuzz", None)[1],
        "staff": tokens.create_token(admin, "fuzz", None)[1],
    }


def fuzz(
    who: str, secret: str, url: str, args: argparse.Namespace, tmp: Path
) -> dict[str, Any]:
    cfg = tmp / f"{who}.toml"
    cfg.write_text(config_toml(args))
    report_dir = tmp / who
    cmd = [
        str(Path(sys.executable).parent / "st"),
        "--no-color",
        "--config-file",
        str(cfg),
        "run",
        f"{url}/api/v1/schema/",
        "--checks",
        "all",
        "--exclude-checks",
        "positive_data_acceptance",
        "--workers",
        str(args.workers),
        "--max-time",
        str(args.max_time),
        "--max-response-time",
        str(MAX_RESPONSE_S),
        "--request-timeout",
        "60",
        "--header",
        f"Authorization: Bearer {secret}",
        "--report",
        "junit",
        "--report-dir",
        str(report_dir),
        "--continue-on-failure",
    ]
    env = {
        **os.environ,
        "SCHEMATHESIS_HOOKS": "schema_fuzz_stack",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "bench"), str(ROOT)]),
    }
    started = time.monotonic()
    # in tmp: st keeps a crash cache (.schemathesis/) in its working directory
    run = subprocess.run(
        cmd, cwd=tmp, env=env, capture_output=True, text=True, check=False
    )
    wall = time.monotonic() - started
    output = run.stdout + run.stderr
    if args.out_dir is not None:
        (args.out_dir / f"schema_fuzz_stack_{who}.log").write_text(output)
    return {
        "persona": who,
        "exit_code": run.returncode,
        "summary": _summary(output),
        "failures": _failures(output),
        "wall_s": round(wall, 1),
    }


def _summary(output: str) -> list[str]:
    """schemathesis' own tallies: each phase's line (scenarios, API links
    covered), and its SUMMARY section."""
    lines = output.splitlines()
    phases = [
        line.rstrip()
        for i, line in enumerate(lines)
        if re.match(r"\s*\S+\s+(Examples|Coverage|Fuzzing|Stateful) \(", line)
        or re.match(r"\s+(Scenarios|API Links):", line)
    ]
    at = next((i for i, x in enumerate(lines) if "SUMMARY" in x), len(lines))
    return phases + [line.rstrip() for line in lines[at:] if line.strip()]


def _failures(output: str) -> list[str]:
    """schemathesis' FAILURES and ERRORS sections, each failure in its words."""
    lines = output.splitlines()
    keep, inside = [], False
    for line in lines:
        if re.match(r"=+ (FAILURES|ERRORS) =+", line):
            inside = True
        elif re.match(r"=+ \w", line):
            inside = False
        if inside:
            keep.append(line.rstrip())
    return keep[:400]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--examples", type=int, default=20)
    parser.add_argument("--seed", type=int, default=27)
    parser.add_argument("--max-time", type=int, default=600, help="s per persona")
    parser.add_argument("--max-steps", type=int, default=20)
    # hypothesis' lambda descriptions are not thread-safe: with 2 workers a
    # coverage phase once died on "AST constructor recursion depth mismatch"
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--phases", default=",".join(PHASES))
    parser.add_argument(
        "--persona", choices=["member", "staff", "both"], default="both"
    )
    parser.add_argument("--cluster", default="2x4:A100-80GB")
    parser.add_argument("--out-dir", type=Path, default=None)
    args = parser.parse_args()
    args.phases = args.phases.split(",")
    if args.out_dir is not None:
        args.out_dir.mkdir(parents=True, exist_ok=True)
    load_before = loadavg()
    extra_env = {
        "GPULAB_API_RATE_LIMIT": "1000000",  # the fuzzer is no abuser
        "GPULAB_DEVICE_CODE_RATE": "1000000",
    }
    personas = ["member", "staff"] if args.persona == "both" else [args.persona]
    with (
        tempfile.TemporaryDirectory(prefix="gpl-fuzz-") as tmp,
        fresh_database("fuzz") as db_url,
    ):
        secrets = make_users()
        with real_stack(db_url, Path(tmp), args.cluster, extra_env) as stack:
            runs = [
                fuzz(who, secrets[who], stack.base_url, args, Path(tmp))
                for who in personas
            ]
            # uvicorn's access lines ("INFO:     127.0.0.1 ...") echo the
            # fuzzed URLs: only the web process's own tracebacks and errors
            web_errors = [
                line
                for _, line in stack.procs["web"].matching(
                    r"^(?!INFO:).*(Traceback \(most recent call last\)|\bERROR\b)"
                )
            ][:40]
    report = {
        "seed": args.seed,
        "examples_per_operation": args.examples,
        "phases": args.phases,
        "max_time_s_per_persona": args.max_time,
        "runs": runs,
        "web_tracebacks": web_errors,
        "load_before": load_before,
        "load_after": loadavg(),
        "machine": machine(),
    }
    for run in runs:
        print(f"== {run['persona']}: exit {run['exit_code']}, {run['wall_s']} s")
        print("\n".join(run["summary"]))
        if run["failures"]:
            print("\n".join(run["failures"]))
    if web_errors:
        print("== web process errors\n" + "\n".join(web_errors))
    print(f"load before {load_before}; after {report['load_after']}")
    if args.out_dir is not None:
        (args.out_dir / "schema_fuzz_stack.json").write_text(
            json.dumps(report, indent=2) + "\n"
        )
    return 0 if all(r["exit_code"] == 0 for r in runs) and not web_errors else 1


if __name__ == "__main__":
    raise SystemExit(main())

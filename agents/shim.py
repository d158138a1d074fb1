"""Per-job shim: ``python -m agents.shim <job_dir>``.

The launcher starts one shim per attempt in its own session, so it outlives the agent
(as slurmstepd outlives slurmd). The shim:

1. reads ``spec.json`` and records ``shim.pid`` (pid + /proc start time);
2. starts ``/bin/sh -c <command>`` in its own process group, as ``run_as`` when set
   (by its numbers when the launch carries them: ``resolve_run_as``),
   with stdout and stderr appended to ``output.log``, and records ``pgid``;
3. on SIGTERM (the agent wrote ``stop`` first) sends the group the signal named in
   ``stop_signal`` (SIGTERM if none: a checkpointable job's checkpoint signal, e.g.
   SIGUSR1), waits the grace period, then SIGKILLs the group;
   It sleeps in ``sigtimedwait`` (woken by SIGCHLD or SIGTERM), so a long job costs
   next to no CPU;
4. when the command ends, kills what is left of its group (no orphan keeps a GPU),
   reaps it (the shim is a child subreaper) and writes ``exit_code`` atomically
   (the status, ``128 + N`` if killed by signal N).

If the command cannot be started it writes ``launch_error`` instead of ``exit_code``.
Only the command goes to the shell; no other job field is ever interpolated.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import pwd
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.jobtext import is_env_name, normal_workdir
from agents.statedir import atomic_write, proc_start_time, read_text

if TYPE_CHECKING:
    from collections.abc import Mapping

PR_SET_CHILD_SUBREAPER = 36
CLEANUP_GRACE_S = 2.0
POLL_S = 0.05
WAIT_S = 1.0  # longest sleep between checks of the stop file while the job runs


class LaunchError(Exception):
    """The command could not be started; the message is shown to the user."""


def build_env(
    spec: dict[str, Any], base: dict[str, str] | None = None
) -> dict[str, str]:
    """The command's environment: ours minus the agent token, plus the job's own."""
    env = dict(os.environ if base is None else base)
    env.pop("GPULAB_AGENT_TOKEN", None)
    env.update({str(k): str(v) for k, v in spec.get("env", {}).items()})
    env["CUDA_VISIBLE_DEVICES"] = ",".join(spec.get("gpu_uuids", []))
    env["GPULAB_JOB_ID"] = str(spec["job_id"])
    env["GPULAB_ATTEMPT_ID"] = str(spec["attempt_id"])
    return env


def check_env(env: dict[str, Any]) -> None:
    """Each name must be one ``/bin/sh`` keeps: it silently drops others (``FOO\\n``)
    from the job's environment, so such a job fails to launch instead."""
    for name in env:
        if not is_env_name(str(name)):
            raise LaunchError(
                f"environment variable name {name!r} is not a shell name"
                " (letters, digits and _, not starting with a digit)"
            )


def check_workdir(workdir: str, state_root: Path | None = None) -> None:
    """An absolute path to a directory, not inside the agent's state directory
    (``state_root``: its jobs' files, spool and sequence numbers), whatever
    ``..`` or symlinks it goes through."""
    path = Path(workdir)
    if not path.is_absolute():
        raise LaunchError(f"workdir {workdir!r} is not an absolute path")
    if not path.exists():
        raise LaunchError(f"workdir {workdir} does not exist")
    if not path.is_dir():
        raise LaunchError(f"workdir {workdir} is not a directory")
    if state_root is not None and path.resolve().is_relative_to(state_root.resolve()):
        raise LaunchError(
            f"workdir {workdir} is inside the agent's state directory {state_root}"
        )


@dataclass(frozen=True)
class RunAs:
    """Whom the command runs as: numbers, and the name and home it is told."""

    name: str
    uid: int
    gid: int
    groups: list[int]
    home: str | None  # None: the node does not know the account (HOME = workdir)


def resolve_run_as(
    spec: Mapping[str, Any], *, require_local: bool = False
) -> RunAs | None:
    """The account a launch names, None to stay as we are. Raises ``LaunchError``.

    With numbers (``run_as_uid``/``run_as_gid``/``run_as_gids``, from the lab's
    directory) they are used as they are: the node need not know the account.
    uid or gid 0 is refused. ``require_local``: the node's user database must know
    ``run_as`` with the same uid and gid. Without numbers, ``run_as`` is looked up
    by name (``resolve_user``).
    """
    uid, gid = spec.get("run_as_uid"), spec.get("run_as_gid")
    name = spec.get("run_as") or ""
    if uid is None or gid is None:
        account = resolve_user(spec.get("run_as"))
        if account is None:
            return None
        return RunAs(
            account.pw_name,
            account.pw_uid,
            account.pw_gid,
            os.getgrouplist(account.pw_name, account.pw_gid),
            account.pw_dir,
        )
    gids = [int(g) for g in spec.get("run_as_gids") or []]
    who = f"{name!r} (uid {uid})" if name else f"uid {uid}"
    if uid == 0 or gid == 0 or 0 in gids:
        raise LaunchError(
            f"refusing to run a job as {who} with gid {gid}, groups {gids}:"
            " uid 0 and gid 0 are root's"
        )
    local: pwd.struct_passwd | None = None
    with contextlib.suppress(KeyError):
        local = pwd.getpwnam(name) if name else pwd.getpwuid(uid)
    if require_local:
        if local is None:
            raise LaunchError(
                f"account {who} is not in this node's user database, which the"
                " agent requires (--require-local-account)"
            )
        if (local.pw_uid, local.pw_gid) != (uid, gid):
            raise LaunchError(
                f"account {name!r} is uid {uid} gid {gid} in the directory but uid"
                f" {local.pw_uid} gid {local.pw_gid} on this node"
                " (--require-local-account)"
            )
    if uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name
        raise LaunchError(f"cannot run as {who}: the agent runs as {me!r}, not root")
    home = local.pw_dir if local is not None and local.pw_uid == uid else None
    return RunAs(name or str(uid), uid, gid, sorted({gid, *gids}), home)


def resolve_user(run_as: str | None) -> pwd.struct_passwd | None:
    """The account to switch to, None to stay as we are. Raises ``LaunchError``."""
    if run_as is None:
        return None
    try:
        account = pwd.getpwnam(run_as)
    except KeyError:
        raise LaunchError(f"unknown Unix account {run_as!r} on this node") from None
    if account.pw_uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        me = pwd.getpwuid(os.geteuid()).pw_name
        raise LaunchError(
            f"cannot run as {run_as!r}: the agent runs as {me!r}, not root"
        )
    return account


class _Stop:
    requested = False


def _on_sigterm(_signum: int, _frame: object) -> None:
    _Stop.requested = True


def _ignore(_signum: int, _frame: object) -> None:
    return None


_WAKE_SIGNALS = {signal.SIGCHLD, signal.SIGTERM}


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _killpg(pgid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _reap_any() -> list[tuple[int, int]]:
    """Reap every exited child (ours or re-parented to us); (pid, status) pairs."""
    done: list[tuple[int, int]] = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return done
        if pid == 0:
            return done
        done.append((pid, status))


def _stop_grace(job_dir: Path, default: float) -> float:
    text = read_text(job_dir / "stop")
    if text:
        with contextlib.suppress(ValueError, IndexError):
            return max(0.0, float(text.split()[0]))
    return default


# The signals a kill may start with (agents.protocol.KillSignal), by name.
_STOP_SIGNALS = {
    "TERM": signal.SIGTERM,
    "INT": signal.SIGINT,
    "USR1": signal.SIGUSR1,
    "USR2": signal.SIGUSR2,
}


def _stop_signal(job_dir: Path) -> int:
    """The signal to stop the job with: ``stop_signal``'s name, else SIGTERM."""
    name = (read_text(job_dir / "stop_signal") or "").strip()
    return _STOP_SIGNALS.get(name, signal.SIGTERM)


# Signals a job gets with their default action again (``_default_signals``).
JOB_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)


def _default_signals() -> None:
    """In the job's child, before its exec: an ignored signal stays ignored
    across exec, and a shell cannot even trap one ignored at its start; the shim
    ignores SIGINT and SIGHUP for itself (and an agent started by ``nohup`` or in
    the background passes SIGINT and SIGQUIT on ignored), so without this a job
    whose checkpoint signal is INT would never see it."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


def run(job_dir: Path) -> int:
    """Run the job in ``job_dir`` to completion; returns the shim's exit status."""
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    atomic_write(
        job_dir / "shim.pid", f"{os.getpid()} {proc_start_time(os.getpid())}\n"
    )
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    spec = json.loads((job_dir / "spec.json").read_text())
    grace = float(spec.get("grace_s", 30))
    if (job_dir / "stop").exists():
        # Killed before it started: nothing to run.
        atomic_write(job_dir / "exit_code", f"{128 + signal.SIGTERM}\n")
        return 0
    try:
        workdir = normal_workdir(spec["workdir"])
        check_workdir(workdir, state_root=job_dir.parent.parent)
        check_env(spec.get("env", {}))
        account = resolve_run_as(spec)
        env = build_env(spec)
        kwargs: dict[str, Any] = {}
        if account is not None:
            # setgroups, setgid, setuid in the child, in that order (Popen's).
            kwargs = {
                "user": account.uid,
                "group": account.gid,
                "extra_groups": account.groups,
            }
            env.update(
                HOME=account.home or workdir,
                USER=account.name,
                LOGNAME=account.name,
            )
        with (job_dir / "output.log").open("ab") as log:
            child = subprocess.Popen(
                ["/bin/sh", "-c", spec["command"]],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                close_fds=True,
                process_group=0,
                preexec_fn=_default_signals,
                **kwargs,
            )
    except LaunchError as exc:
        atomic_write(job_dir / "launch_error", f"{exc}\n")
        return 0
    except (OSError, ValueError) as exc:
        # ValueError: an environment variable name with "=", a NUL byte: the
        # portal refuses both, but a bad spec must end as a launch failure (the
        # job's fault), not as a shim dying without a result (the node's).
        atomic_write(job_dir / "launch_error", f"could not start the command: {exc}\n")
        return 0

    pgid = child.pid  # process_group=0: the child leads its own group
    atomic_write(job_dir / "pgid", f"{pgid}\n")

    # Sleep in sigtimedwait rather than polling: a child's exit (SIGCHLD) or the
    # agent's SIGTERM wakes us at once, the timeout only re-checks the stop file.
    # Blocked now, after the command started (it must not inherit the mask); a
    # SIGTERM that came earlier went to the handler, a SIGCHLD is found by waitpid.
    signal.signal(signal.SIGCHLD, _ignore)
    signal.pthread_sigmask(signal.SIG_BLOCK, _WAKE_SIGNALS)
    status: int | None = None
    kill_at: float | None = None
    while status is None:
        for pid, st in _reap_any():
            if pid == child.pid:
                status = st
        if status is not None:
            break
        # The agent writes ``stop`` before signalling; checking the file too closes
        # the window where a SIGTERM could arrive before our handler existed.
        if kill_at is None and (_Stop.requested or (job_dir / "stop").exists()):
            grace = _stop_grace(job_dir, grace)
            _killpg(pgid, _stop_signal(job_dir))
            kill_at = time.monotonic() + grace
        if kill_at is not None and time.monotonic() >= kill_at:
            _killpg(pgid, signal.SIGKILL)
        if kill_at is None:
            timeout = WAIT_S
        else:
            timeout = max(POLL_S, min(WAIT_S, kill_at - time.monotonic()))
        info = signal.sigtimedwait(_WAKE_SIGNALS, timeout)
        if info is not None and info.si_signo == signal.SIGTERM:
            _Stop.requested = True
    child.returncode = os.waitstatus_to_exitcode(status)  # Popen must not re-wait

    # What is left of the group (background processes) must not outlive the job.
    if _group_alive(pgid):
        _killpg(pgid, signal.SIGTERM)
        deadline = (
            kill_at if kill_at is not None else time.monotonic() + CLEANUP_GRACE_S
        )
        while _group_alive(pgid) and time.monotonic() < deadline:
            _reap_any()
            time.sleep(POLL_S)
        _killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while _group_alive(pgid) and time.monotonic() < deadline:
            _reap_any()
            time.sleep(POLL_S)

    code = os.waitstatus_to_exitcode(status)
    exit_code = 128 - code if code < 0 else code
    atomic_write(job_dir / "exit_code", f"{exit_code}\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.stderr.write("usage: python -m agents.shim <job_dir>\n")
        return 2
    return run(Path(args[0]))


if __name__ == "__main__":
    sys.exit(main())

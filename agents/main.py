"""Command line of the node agent (``python -m agents`` / ``gpulab-agent``).

The token comes from ``--token-file`` or ``GPULAB_AGENT_TOKEN``, never from the
command line (``ps`` would show it), and is never logged. Exit codes: 0 after a
SIGTERM/SIGINT shutdown, 2 for a configuration problem (no token, no NVIDIA driver
without ``--simulate``, bad spec or simulation file, unknown --default-account).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import pwd
import signal
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

from agents.statedir import default_state_dir

if TYPE_CHECKING:
    from agents.agent import SimHooks
    from agents.nvml import GpuReader

log = logging.getLogger("agents")


class ConfigError(Exception):
    """A problem with how the agent was started; the message says how to fix it."""


def server_url(url: str) -> str:
    """Append ``/ws/agent/`` when the URL has no path."""
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss"):
        raise ConfigError(f"--server {url!r} must start with ws:// or wss://")
    if not parts.netloc:
        raise ConfigError(f"--server {url!r} has no host")
    if parts.path in ("", "/"):
        parts = parts._replace(path="/ws/agent/")
    return urlunsplit(parts)


def read_token(token_file: str | None) -> str:
    if token_file:
        try:
            token = Path(token_file).read_text().strip()
        except OSError as exc:
            raise ConfigError(
                f"cannot read the token file {token_file}: {exc.strerror}"
            ) from None
        if not token:
            raise ConfigError(f"the token file {token_file} is empty")
        return token
    token = os.environ.get("GPULAB_AGENT_TOKEN", "").strip()
    if not token:
        raise ConfigError(
            "no agent token: pass --token-file FILE or set GPULAB_AGENT_TOKEN"
            " (create one with `python manage.py create_node NAME`)"
        )
    return token


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="gpulab-agent", description="gpulab node agent: runs jobs on this node."
    )
    ap.add_argument("--server", required=True, help="ws://HOST:PORT[/ws/agent/]")
    ap.add_argument("--token-file", help="file holding the node token")
    ap.add_argument(
        "--simulate",
        metavar="SPEC",
        help="simulate GPUs: a node spec (4xA100-80GB[:nvlink]) or a .json/.yaml"
        " file with GPUs and faults (see agents/simulate.py)",
    )
    ap.add_argument(
        "--state-dir",
        type=Path,
        help="default: $GPULAB_STATE_DIR/agent, else /var/lib/gpulab-agent",
    )
    ap.add_argument("--heartbeat", type=float, default=5.0, metavar="S")
    ap.add_argument("--sample-interval", type=float, default=1.0, metavar="S")
    ap.add_argument("--backoff-base", type=float, default=1.0, metavar="S")
    ap.add_argument("--backoff-cap", type=float, default=20.0, metavar="S")
    ap.add_argument("--hostname", default="", help="default: this machine's name")
    ap.add_argument(
        "--allow-root-jobs",
        action="store_true",
        help="when the agent runs as root, allow jobs without run_as to run as root",
    )
    ap.add_argument(
        "--default-account",
        metavar="USER",
        help="when the agent runs as root, run jobs that name no run_as as USER",
    )
    ap.add_argument(
        "--require-local-account",
        action="store_true",
        default=os.environ.get("GPULAB_AGENT_REQUIRE_LOCAL_ACCOUNT", "").lower()
        in ("1", "true", "yes", "on"),
        help="run a job under the uid/gid its launch carries (from the lab's"
        " directory) only if this node's user database has the account with the"
        " same numbers (default: $GPULAB_AGENT_REQUIRE_LOCAL_ACCOUNT, else off)",
    )
    ap.add_argument(
        "--spool-metrics-interval",
        type=float,
        default=10.0,
        metavar="S",
        help="while disconnected, spool one metrics sample every S seconds (10)",
    )
    ap.add_argument(
        "--spool-max-mb",
        type=float,
        default=64.0,
        metavar="MB",
        help="spool size cap; the oldest metric samples are dropped first (64)",
    )
    ap.add_argument(
        "--kill-after-disconnect",
        type=float,
        default=None,
        metavar="S",
        help="stop every job once the portal has been unreachable for S seconds"
        " (default: never)",
    )
    ap.add_argument(
        "--terminal-linger",
        type=float,
        default=300.0,
        metavar="S",
        help="hang up a terminal of an interactive job S seconds after its last"
        " viewer left, unless one attaches again (300)",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return ap


def check_account(name: str | None) -> None:
    if name is None:
        return
    try:
        account = pwd.getpwnam(name)
    except KeyError:
        raise ConfigError(
            f"--default-account: unknown Unix account {name!r} on this node"
        ) from None
    if account.pw_uid == 0:
        raise ConfigError(
            f"--default-account {name!r} is root; use --allow-root-jobs instead"
        )


def make_reader(
    simulate: str | None, hostname: str
) -> tuple[GpuReader, SimHooks | None]:
    from agents.nvml import NvmlReader, NvmlUnavailable

    if simulate:
        from agents.simulate import SimNvml, load_simulation
        from agents.spec import SpecError

        try:
            spec, faults = load_simulation(simulate)
        except SpecError as exc:
            raise ConfigError(f"--simulate: {exc}") from None
        sim = SimNvml(spec, hostname=hostname, faults=faults)
        return NvmlReader(sim), sim
    import pynvml  # type: ignore[import-untyped]

    try:
        return NvmlReader(pynvml), None
    except NvmlUnavailable as exc:
        raise ConfigError(str(exc)) from None


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("websockets").setLevel(logging.WARNING)
    from agents.agent import Agent, Config

    hostname = args.hostname or socket.gethostname()
    try:
        token = read_token(args.token_file)
        url = server_url(args.server)
        check_account(args.default_account)
        if args.spool_max_mb <= 0 or args.spool_metrics_interval < 0:
            raise ConfigError(
                "--spool-max-mb must be > 0 and --spool-metrics-interval >= 0"
            )
        if args.terminal_linger < 0:
            raise ConfigError("--terminal-linger must be >= 0 seconds")
        if args.kill_after_disconnect is not None and args.kill_after_disconnect <= 0:
            raise ConfigError("--kill-after-disconnect must be > 0 seconds")
        reader, sim = make_reader(args.simulate, hostname)
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    config = Config(
        server=url,
        token=token,
        state_dir=args.state_dir or default_state_dir(),
        heartbeat_s=args.heartbeat,
        sample_interval_s=args.sample_interval,
        backoff_base_s=args.backoff_base,
        backoff_cap_s=args.backoff_cap,
        allow_root_jobs=args.allow_root_jobs,
        hostname=hostname,
        default_account=args.default_account,
        require_local_account=args.require_local_account,
        spool_metrics_interval_s=args.spool_metrics_interval,
        spool_max_bytes=int(args.spool_max_mb * 1024 * 1024),
        kill_after_disconnect_s=args.kill_after_disconnect,
        terminal_linger_s=args.terminal_linger,
    )

    async def run() -> None:
        try:
            agent = Agent(config, reader, sim)
        except OSError as exc:
            raise ConfigError(f"state directory {config.state_dir}: {exc}") from None
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, agent.shutdown.set)
        log.info(
            "agent %s on %s, state in %s, server %s%s",
            agent.incarnation,
            hostname,
            config.state_dir,
            url,
            f", simulating {args.simulate}" if args.simulate else "",
        )
        await agent.run()

    try:
        asyncio.run(run())
    except ConfigError as exc:
        log.error("%s", exc)
        return 2
    return 0

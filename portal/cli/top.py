"""``gpulab top``: the cluster in the terminal, like ``nvitop``: every node, its
GPUs with utilisation and memory bars, temperature, power and who holds them,
redrawn from the API every few seconds; ``q`` or Ctrl-C quits.

A frame is a pure function of what the API returned (``frame``), so ``--once``
prints exactly what the live view shows.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from agents.jobtext import for_terminal
from portal.cli.errors import CliError, Exit
from portal.cli.output import mib, parse_time

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from rich.console import RenderableType

    from portal.cli.client import Api

BAR = 20


def bar(fraction: float | None, width: int = BAR) -> Text:
    """``█████░░░░░  48%``: green, yellow from 50 %, red from 80 %; blank when
    the GPU did not report it (never drawn as zero)."""
    if fraction is None:
        return Text("·" * width + "    -", style="dim")
    f = min(1.0, max(0.0, fraction))
    filled = round(f * width)
    style = "red" if f >= 0.8 else "yellow" if f >= 0.5 else "green"
    text = Text("█" * filled, style=style)
    text.append("░" * (width - filled), style="dim")
    text.append(f" {f * 100:3.0f}%")
    return text


def _age(value: str | None, now: datetime) -> str:
    at = parse_time(value)
    if at is None:
        return "never seen"
    seconds = max(0, int((now - at).total_seconds()))
    return f"seen {seconds}s ago" if seconds < 120 else f"seen {seconds // 60}m ago"


def frame(
    server: str,
    nodes: Sequence[Mapping[str, Any]],
    queue: Sequence[Mapping[str, Any]],
    now: datetime | None = None,
) -> RenderableType:
    """One screen: a summary line, then a table per node with a row per GPU."""
    now = now or datetime.now(UTC)
    gpus = [g for n in nodes for g in n["gpus"]]
    busy = sum(1 for g in gpus if g["jobs"])
    running = sum(1 for j in queue if j["state"] in ("starting", "running"))
    pending = sum(1 for j in queue if j["state"] == "pending")
    head = Text.assemble(
        ("gpulab top", "bold"),
        f"  {server}  {now.astimezone().strftime('%H:%M:%S')}   ",
        (f"{len(nodes)} node{'' if len(nodes) == 1 else 's'}", "bold"),
        ", ",
        (f"{busy}/{len(gpus)} GPUs in use", "bold"),
        ", ",
        (f"{running} running", "bold green"),
        ", ",
        (f"{pending} pending", "bold yellow"),
    )
    parts: list[RenderableType] = [head]
    for node in nodes:
        state = node["state"]
        flags = [state]
        if node.get("mode"):
            flags.append(node["mode"])
        if not node.get("connected"):
            flags.append("disconnected")
        style = "green" if state == "up" and node.get("takes_jobs") else "yellow"
        if state == "lost":
            style = "red"
        title = Text.assemble(
            (node["name"], "bold"),
            "  ",
            (" ".join(flags), style),
            f"  {_age(node.get('last_seen_at'), now)}",
        )
        grid = Table(
            title=title,
            title_justify="left",
            expand=False,
            box=None,
            pad_edge=False,
            show_edge=False,
        )
        grid.add_column("GPU", justify="right")
        grid.add_column("MODEL")
        grid.add_column("UTIL")
        grid.add_column("MEMORY")
        grid.add_column("TEMP", justify="right")
        grid.add_column("POWER", justify="right")
        grid.add_column("JOBS")
        for gpu in node["gpus"]:
            total = gpu.get("memory_total_mib") or 0
            used = gpu.get("memory_used_mib")
            util = gpu.get("util_gpu")
            memory = bar(used / total if used is not None and total else None)
            memory.append(f"  {mib(used)}/{mib(total)}")
            jobs = for_terminal(
                ", ".join(f"{j['owner']}:{j['id']} {j['name']}" for j in gpu["jobs"])
            )
            if not gpu.get("present", True):
                jobs = "[lost] " + jobs
            elif gpu.get("mig_enabled"):
                jobs = "[MIG] " + jobs
            temp = gpu.get("temperature_c")
            power = gpu.get("power_w")
            grid.add_row(
                str(gpu["index"]),
                gpu["name"],
                bar(util / 100 if util is not None else None),
                memory,
                "-" if temp is None else f"{temp:.0f}C",
                "-" if power is None else f"{power:.0f}W",
                Text(jobs or "idle", style="" if jobs else "dim"),
            )
        parts += [Text(""), grid]
    if not nodes:
        parts.append(Text("No nodes registered.", style="dim"))
    return Group(*parts)


def fetch(api: Api) -> tuple[list[Any], list[Any]]:
    return api.get("nodes/"), api.get("queue/")


def print_once(api: Api, console: Console) -> None:
    nodes, queue = fetch(api)
    console.print(frame(api.server, nodes, queue))


@contextlib.contextmanager
def _keys() -> Iterator[Callable[[float], str]]:
    """``wait(seconds)`` -> the key pressed within that time ('' if none): the
    terminal in cbreak mode while the view runs (no echo, no Enter needed)."""
    stdin = sys.stdin
    if not stdin.isatty():

        def sleep(seconds: float) -> str:
            time.sleep(seconds)
            return ""

        yield sleep
        return
    import termios
    import tty

    fd = stdin.fileno()
    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def wait(seconds: float) -> str:
            ready, _, _ = select.select([fd], [], [], seconds)
            return os.read(fd, 1).decode(errors="replace") if ready else ""

        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def live(api: Api, console: Console, interval: float) -> None:
    """Redraw every ``interval`` seconds until ``q`` (or Ctrl-C). A failed fetch
    is shown on the screen and retried; a refused token ends the view."""
    with (
        _keys() as wait,
        Live(console=console, screen=True, auto_refresh=False) as view,
    ):
        while True:
            try:
                view.update(frame(api.server, *fetch(api)), refresh=True)
            except CliError as exc:
                if exc.exit_code == Exit.AUTH:
                    raise
                view.update(
                    Text(f"gpulab top: {exc.format_message()} (retrying)", "red"),
                    refresh=True,
                )
            if wait(interval).lower() == "q":
                return

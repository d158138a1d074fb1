"""Training loops for the real-GPU measurements: the seed study's models and more.

Five real PyTorch training loops on synthetic data of realistic shapes (the seed
study's FCN, VGG-19, ResNet-50 and LSTM, and a small transformer), each with a batch
size option, and a ``fake`` workload with the same interface and no torch (CI).

Two ways to run one:

``serve`` (the pair harness, ``bench.gpu.pairs``): a long-lived process that builds
the model once (CUDA initialised once), says ``ready`` on stdout as a JSON line, then
answers JSON-line commands on stdin::

    {"cmd": "run", "start_at": <epoch s>, "warmup": 5, "window": 10}
    -> {"event": "result", "steps": 412, "rate": 41.2, ...}
    {"cmd": "quit"}

``run`` waits until ``start_at``, trains for ``warmup`` seconds, then counts the
steps that end within the next ``window`` seconds (each step synchronises the GPU,
so a step's end is when its kernels finished). Two servers given the same
``start_at`` measure the same window while sharing the GPU by time-slicing.

``job`` (a job the agent launches): calibrates for 3 s, sets its total to the steps
that fit in ``--seconds`` at that rate, and trains to it, printing
``GPULAB_PROGRESS step/total`` about once a second.

Out of GPU memory, at build or in a run, is reported (``"oom": true``), not raised.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable

# name -> (family, default batch size)
SUITE: dict[str, tuple[str, int]] = {
    "fcn": ("FCN", 8),
    "vgg19": ("VGG-19", 32),
    "resnet50": ("ResNet-50", 64),
    "lstm": ("LSTM", 20),
    "transformer": ("Transformer", 32),
    # No torch: steps take the shared lock file for --fake-step-s seconds, so two
    # fakes slice time the way two processes on one GPU do.
    "fake-a": ("FakeA", 1),
    "fake-b": ("FakeB", 1),
    "fake-c": ("FakeC", 1),
}


def job_name(model: str, batch: int) -> str:
    """The Gavel-style job type name, e.g. ``ResNet-50 (batch size 64)``."""
    return f"{SUITE[model][0]} (batch size {batch})"


class OutOfMemory(Exception):
    """The workload did not fit in GPU memory."""


@dataclass
class Workload:
    """One training step (``step()``, synchronous) and what it holds on the GPU."""

    step: Callable[[], None]
    memory_mib: Callable[[], float]


# ---------------------------------------------------------------- torch models


def _torch_workload(model: str, batch: int) -> Workload:  # pragma: no cover - GPU
    import torch  # type: ignore[import-not-found]
    from torch import nn

    torch.backends.cudnn.benchmark = True
    dev = torch.device("cuda")
    loss_fn = nn.CrossEntropyLoss()
    net: nn.Module
    if model in ("vgg19", "resnet50"):
        import torchvision  # type: ignore[import-not-found]

        net = getattr(torchvision.models, model)(weights=None)
        x = torch.randn(batch, 3, 224, 224, device=dev)
        y = torch.randint(0, 1000, (batch,), device=dev)

        def forward() -> Any:
            return loss_fn(net(x), y)

    elif model == "fcn":
        from torchvision.models.segmentation import (  # type: ignore[import-not-found]
            fcn_resnet50,
        )

        net = fcn_resnet50(weights=None, weights_backbone=None, num_classes=21)
        x = torch.randn(batch, 3, 384, 384, device=dev)
        y = torch.randint(0, 21, (batch, 384, 384), device=dev)

        def forward() -> Any:
            return loss_fn(net(x)["out"], y)

    elif model == "lstm":
        vocab, hidden, seq = 10_000, 650, 35  # the PTB "medium" language model

        class LM(nn.Module):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(vocab, hidden)
                self.rnn = nn.LSTM(hidden, hidden, num_layers=2, dropout=0.5)
                self.out = nn.Linear(hidden, vocab)

            def forward(self, t: Any) -> Any:
                h, _ = self.rnn(self.emb(t))
                return self.out(h)

        net = LM()
        x = torch.randint(0, vocab, (seq, batch), device=dev)
        y = torch.randint(0, vocab, (seq * batch,), device=dev)

        def forward() -> Any:
            return loss_fn(net(x).view(-1, vocab), y)

    elif model == "transformer":
        vocab, d, seq = 32_000, 512, 256

        class TLM(nn.Module):  # type: ignore[misc]
            def __init__(self) -> None:
                super().__init__()
                self.emb = nn.Embedding(vocab, d)
                layer = nn.TransformerEncoderLayer(
                    d, nhead=8, dim_feedforward=2048, batch_first=True
                )
                self.enc = nn.TransformerEncoder(layer, num_layers=6)
                self.out = nn.Linear(d, vocab)

            def forward(self, t: Any) -> Any:
                return self.out(self.enc(self.emb(t)))

        net = TLM()
        x = torch.randint(0, vocab, (batch, seq), device=dev)
        y = torch.randint(0, vocab, (batch * seq,), device=dev)

        def forward() -> Any:
            return loss_fn(net(x).view(-1, vocab), y)

    else:
        raise ValueError(f"unknown model {model!r}")
    try:
        net = net.to(dev).train()
        opt: torch.optim.Optimizer = (
            torch.optim.Adam(net.parameters(), lr=1e-4)
            if model == "transformer"
            else torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
        )
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(str(exc)) from None

    def step() -> None:
        try:
            opt.zero_grad(set_to_none=True)
            forward().backward()
            opt.step()
            torch.cuda.synchronize()
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(str(exc)) from None

    def memory_mib() -> float:
        return float(torch.cuda.max_memory_reserved()) / 2**20

    return Workload(step, memory_mib)


# ---------------------------------------------------------------- fake


def _fake_workload(step_s: float, lock: Path, memory_mib: float) -> Workload:
    """A step holds an exclusive lock on ``lock`` for ``step_s`` s: alone it runs
    1/step_s steps a second; two fakes on one lock each get about half. Each fake
    holds ``memory_mib`` while it lives, registered beside the lock; one that would
    take the live fakes over ``GPULAB_FAKE_GPU_MIB`` together fails at start, out
    of memory, as a process on a full GPU does."""
    registry = lock.with_suffix(".mem")
    registry.mkdir(parents=True, exist_ok=True)
    cap = float(os.environ.get("GPULAB_FAKE_GPU_MIB", "inf"))
    with lock.open("a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        used = sum(float(p.read_text() or 0) for p in registry.iterdir() if _alive(p))
        if used + memory_mib > cap:
            raise OutOfMemory(
                f"fake GPU: {used:.0f} + {memory_mib:.0f} MiB > {cap:.0f}"
            )
        (registry / str(os.getpid())).write_text(str(memory_mib))

    def step() -> None:
        # Sleeping, not spinning, while holding the lock: a spinning fake that the
        # OS preempts outside the lock on a loaded machine runs slower alone than
        # its share in a pair, and the pair's sum comes out above one.
        with lock.open("a") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            time.sleep(step_s)

    return Workload(step, lambda: memory_mib)


def _alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.name), 0)
    except (ValueError, ProcessLookupError):
        return False
    except PermissionError:
        return True
    return True


def build(args: argparse.Namespace) -> Workload:
    if args.model.startswith("fake"):
        return _fake_workload(args.fake_step_s, Path(args.fake_lock), args.fake_mib)
    return _torch_workload(args.model, args.batch)  # pragma: no cover - GPU


# ---------------------------------------------------------------- measuring


def measure(
    work: Workload, start_at: float, warmup: float, window: float
) -> dict[str, Any]:
    """Steps that end within [start_at + warmup, start_at + warmup + window]."""
    delay = start_at - time.time()
    if delay > 0:
        time.sleep(delay)
    t0 = time.time()
    begin, end = t0 + warmup, t0 + warmup + window
    steps = 0
    while True:
        work.step()
        now = time.time()
        if now > end:
            break
        if now >= begin:
            steps += 1
    return {
        "steps": steps,
        "window_s": window,
        "rate": steps / window,
        "late_s": round(t0 - start_at, 3),
    }


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(args: argparse.Namespace) -> int:
    name = job_name(args.model, args.batch)
    try:
        work = build(args)
        work.step()  # the first step allocates and autotunes
        work.step()
    except OutOfMemory as exc:
        _emit({"event": "error", "name": name, "oom": True, "error": str(exc)})
        return 1
    _emit(
        {
            "event": "ready",
            "name": name,
            "pid": os.getpid(),
            "memory_mib": work.memory_mib(),
        }
    )
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["cmd"] == "quit":
            break
        try:
            result = measure(
                work, float(cmd["start_at"]), float(cmd["warmup"]), float(cmd["window"])
            )
        except OutOfMemory as exc:
            _emit({"event": "result", "name": name, "oom": True, "error": str(exc)})
            continue
        _emit(
            {
                "event": "result",
                "name": name,
                "oom": False,
                "memory_mib": work.memory_mib(),
                **result,
            }
        )
    return 0


def job(args: argparse.Namespace) -> int:
    """Train for about ``--seconds`` after a 3-s calibration, reporting progress."""
    work = build(args)
    work.step()
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 3.0:
        work.step()
        n += 1
    rate = n / (time.monotonic() - t0)
    total = max(1, round(rate * args.seconds))
    print(f"{job_name(args.model, args.batch)}: {rate:.2f} steps/s", flush=True)
    last = 0.0
    for step in range(1, total + 1):
        work.step()
        now = time.monotonic()
        if now - last >= 1.0 or step == total:
            print(f"GPULAB_PROGRESS {step}/{total}", flush=True)
            last = now
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.workloads")
    ap.add_argument("mode", choices=["serve", "job"])
    ap.add_argument("--model", required=True, choices=sorted(SUITE))
    ap.add_argument("--batch", type=int, help="default: the model's own")
    ap.add_argument("--seconds", type=float, default=30.0, help="job: how long")
    ap.add_argument("--fake-step-s", type=float, default=0.01)
    ap.add_argument("--fake-lock", default="/tmp/gpulab-fake-gpu.lock")
    ap.add_argument("--fake-mib", type=float, default=1000.0)
    args = ap.parse_args(argv)
    if args.batch is None:
        args.batch = SUITE[args.model][1]
    if args.batch < 1:
        ap.error("--batch must be >= 1")
    return serve(args) if args.mode == "serve" else job(args)


if __name__ == "__main__":
    sys.exit(main())

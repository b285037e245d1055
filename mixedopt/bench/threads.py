"""``python -m mixedopt.bench.threads``: training throughput of several Python threads at once.

Each of N threads (``--threads 1,2,4``) trains a model of its own with an optimizer of its own:
``--layers`` x (``Linear(--width, --width)``, ``Tanh``), batch ``--batch``, an iteration being a
forward under ``torch.autocast(float16)``, ``backward()``, ``step()`` and ``zero_grad()``. The
optimizers are a pair of ``small.PAIRS`` (``--optimizer``): torch.optim with ``foreach=True``
next to mixedopt with its defaults (AdamW by default).

How it is measured
    Every model, input and optimizer is built in the main thread before any thread starts:
    building a module draws its weights from the global generator, which threads would race
    on. Thread ``i`` trains the same weights (seed ``i``) with either library. A run of one
    library at one N starts N threads; each takes ``--warmup`` untimed iterations, waits at a
    ``threading.Barrier`` so that all start together, then times ``--iterations`` iterations
    (the device synchronised after them on CUDA). The run's throughput is the iterations of all
    threads over the time from the first thread's start to the last one's end. torch.optim and
    mixedopt take turns, each round starting with the other (``small.in_turn``), for
    ``--rounds`` rounds; the table shows the median throughput of each, in iterations per second
    of all threads together, and the time ratio of the other benchmarks: mixedopt's time per
    iteration over torch.optim's (torch.optim's throughput over mixedopt's), lower is faster.
    The models keep training from round to round.

    ``torch.set_num_threads(1)`` (``--torch-threads``) for the run, so that each thread's
    operations run on that thread alone and N threads keep N cores busy. Each thread sets it
    again when it starts: OpenMP's thread count is a setting of each thread, and a thread that
    torch did not start has OpenMP's default (one per core) until torch sets it there (measured:
    60 times slower iterations on a busy 2-core machine without). An operation releases the
    GIL while it computes, while the Python of an iteration (module calls, the optimizers'
    bookkeeping) holds it: throughput that grows less than N-fold shows that share, or cores
    fewer than N.

    After each N the weights of every mixedopt model are checked to be finite (a warning line
    after the table where they are not), a cheap check that the threads did not corrupt one
    another's training. A run that raises is shown in its cell, the error after the table, and
    the exit status is 1.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from . import small
from .format import machine_info
from .setup import first_line, positive, teardown

# --optimizer -> (its pair in small.PAIRS: torch.optim foreach, mixedopt default; its name here)
OPTIMIZERS: dict[str, tuple[str, str]] = {
    "adamw": ("AdamW, default vs foreach", "AdamW"),
    "sgd": ("SGD momentum, default vs foreach", "SGD momentum 0.9"),
    "rmsprop": ("RMSprop, default vs foreach", "RMSprop"),
}
LIBRARIES = ("torch", "mixedopt")  # in the order of a pair in small.PAIRS


def model(layers: int, width: int, seed: int, device: str = "cpu") -> nn.Module:
    """``layers`` x (``Linear(width, width)``, ``Tanh``), the same for a seed.

    Seeds the global generator: build models in one thread only.
    """
    torch.manual_seed(seed)
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*blocks).to(device)


@dataclass
class Trainer:
    """One thread's model, optimizer and batch."""

    model: nn.Module
    opt: Any
    x: torch.Tensor

    def iteration(self) -> None:
        """Forward under ``autocast(float16)``, ``backward()``, ``step()``, ``zero_grad()``."""
        with torch.autocast(self.x.device.type, dtype=torch.float16):
            loss = self.model(self.x).float().square().mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()

    def synchronize(self) -> None:
        """Wait for the device to finish this trainer's work (nothing to wait for on a CPU)."""
        if self.x.device.type == "cuda":
            torch.cuda.synchronize(self.x.device)

    def finite(self) -> bool:
        """Whether every weight is finite."""
        return all(bool(torch.isfinite(p).all()) for p in self.model.parameters())

    def close(self) -> None:
        """Free the gradients, mixedopt's storage and the optimizer state (``setup.teardown``)."""
        teardown(list(self.model.parameters()), self.opt)


def trainers(
    make: Callable[[Any], Any], count: int, layers: int, width: int, batch: int, device: str
) -> list[Trainer]:
    """``count`` trainers, each with the optimizer ``make`` builds over its model's parameters.

    Trainer ``i``'s model and batch are the same whatever ``make`` is (seed ``i``).
    """
    found = []
    for i in range(count):
        net = model(layers, width, seed=i, device=device)
        x = torch.randn(batch, width, device=device)
        found.append(Trainer(net, make(net.parameters()), x))
    return found


def run_threads(group: Sequence[Trainer], iterations: int, warmup: int) -> float:
    """Iterations per second of all of ``group``, each trainer in a thread of its own.

    Each thread sets torch's thread count to the calling thread's (module docstring), takes
    ``warmup`` untimed iterations, waits for the others at a barrier, then takes ``iterations``
    timed ones; the time is from the first start to the last end.

    Raises:
        BaseException: the first error a thread raised (the others stop at the barrier, or finish
            their iterations where they had passed it).
    """
    barrier = threading.Barrier(len(group))
    spans: list[tuple[float, float]] = []  # list.append is atomic: no lock needed
    errors: list[BaseException] = []
    torch_threads = torch.get_num_threads()

    def work(trainer: Trainer) -> None:
        try:
            torch.set_num_threads(torch_threads)
            for _ in range(warmup):
                trainer.iteration()
            trainer.synchronize()
            barrier.wait()
            start = time.perf_counter()
            for _ in range(iterations):
                trainer.iteration()
            trainer.synchronize()
            spans.append((start, time.perf_counter()))
        except threading.BrokenBarrierError:
            pass  # another thread failed before the barrier: its error is the one raised
        except BaseException as error:
            errors.append(error)
            barrier.abort()

    threads = [
        threading.Thread(target=work, args=(trainer,), name=f"mixedopt-bench-{i}")
        for i, trainer in enumerate(group)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    wall = max(end for _, end in spans) - min(start for start, _ in spans)
    return len(group) * iterations / wall


@dataclass
class Result:
    """One library at one thread count: the throughput of each round, or the error it raised."""

    per_second: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def median(self) -> float | None:
        """The median iterations per second over the rounds (None: it raised, or none ran)."""
        return None if self.error or not self.per_second else statistics.median(self.per_second)


def measure(
    pair: str,
    count: int,
    layers: int,
    width: int,
    batch: int,
    iterations: int,
    warmup: int,
    rounds: int,
    device: str = "cpu",
) -> tuple[dict[str, Result], list[int]]:
    """Both libraries of ``small.PAIRS[pair]`` at ``count`` threads, in turns for ``rounds``.

    Also the threads (0-based) whose mixedopt model has weights that are not finite at the end.
    """
    groups = {
        library: trainers(make, count, layers, width, batch, device)
        for library, make in zip(LIBRARIES, small.PAIRS[pair], strict=True)
    }
    results = {library: Result() for library in LIBRARIES}
    try:
        for round_index in range(rounds):
            for library in small.in_turn(LIBRARIES, round_index):
                result = results[library]
                if result.error is not None:
                    continue  # its models are in whatever state the error left
                try:
                    result.per_second.append(run_threads(groups[library], iterations, warmup))
                except Exception as error:  # the row and the lines after the table say it
                    result.error = f"{type(error).__name__}: {first_line(error)}"
        not_finite = [i for i, trainer in enumerate(groups["mixedopt"]) if not trainer.finite()]
    finally:
        for library, group in groups.items():
            result = results[library]
            for trainer in group:
                try:
                    trainer.close()
                except Exception as error:  # shown like a run's error, where it is the first
                    if result.error is None:
                        result.error = f"releasing: {type(error).__name__}: {first_line(error)}"
    return results, not_finite


def machine(device: torch.device) -> str:
    """What the numbers were measured on: device, cores, torch, mixedopt, Python and the date."""
    # machine_info also reports a stream bandwidth, which this benchmark does not measure.
    info = machine_info(device, {"inplace": math.nan, "out": math.nan}, 0)
    return (
        f"{info['device']} ({info['device_name']}, {info['cpu_count']} CPU cores) | "
        f"torch {info['torch_version']} | mixedopt {info['mixedopt_version']} | "
        f"Python {info['python_version']} ({platform.python_implementation()}) | "
        f"{datetime.date.today().isoformat()}"
    )


def _counts(text: str) -> list[int]:
    """Comma-separated counts of at least 1 (``1,2,4``), each once, in the order given."""
    try:
        counts = [positive(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected counts such as 1,2,4, got {text!r}") from None
    if not counts:
        raise argparse.ArgumentTypeError("give at least one count")
    return list(dict.fromkeys(counts))


def _cell(result: Result) -> str:
    return f"error: {result.error}" if result.error else f"{result.median:.1f}"


def main(argv: Sequence[str] | None = None) -> int:
    """Print the table; return the exit status (1 where a run raised)."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench.threads",
        description="Training throughput of N Python threads, each training its own model with "
        "its own optimizer: torch.optim (foreach) next to mixedopt (default).",
    )
    parser.add_argument(
        "--threads", type=_counts, default=[1, 2, 4], help="comma-separated thread counts (1,2,4)"
    )
    parser.add_argument(
        "--optimizer", choices=list(OPTIMIZERS), default="adamw", help="the pair compared (adamw)"
    )
    parser.add_argument(
        "--iterations", type=positive, default=50, help="timed iterations per thread (50)"
    )
    parser.add_argument(
        "--warmup", type=positive, default=3, help="untimed iterations per thread first (3)"
    )
    parser.add_argument(
        "--rounds", type=positive, default=3, help="runs of each library, in turns (3)"
    )
    parser.add_argument("--layers", type=positive, default=8, help="Linear + Tanh layers (8)")
    parser.add_argument("--width", type=positive, default=256, help="their width (256)")
    parser.add_argument("--batch", type=positive, default=32, help="batch size (32)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument(
        "--torch-threads",
        type=positive,
        default=1,
        help="torch.set_num_threads for the run (1: each Python thread computes on its own core)",
    )
    args = parser.parse_args(argv)
    before = torch.get_num_threads()
    torch.set_num_threads(args.torch_threads)
    try:
        return _run(args)
    finally:
        torch.set_num_threads(before)


def _run(args: argparse.Namespace) -> int:
    pair, name = OPTIMIZERS[args.optimizer]
    device = torch.device(args.device)
    if args.torch_threads == 1:
        pool = "so that N Python threads use N cores"
    else:
        pool = f"a pool the Python threads share ({os.cpu_count()} cores)"
    print(
        f"Training throughput of N threads, each training its own {args.layers} x "
        f"(Linear({args.width}, {args.width}), Tanh), batch {args.batch}, with its own "
        f"optimizer (forward under autocast(float16), backward, step, zero_grad)"
    )
    print(f"machine: {machine(device)}")
    print(
        f"torch.set_num_threads({args.torch_threads}) (--torch-threads), {pool} | median of "
        f"{args.rounds} round(s) of {args.iterations} timed iterations per thread after "
        f"{args.warmup} untimed, torch.optim and mixedopt in turn"
    )
    print()
    torch_label = f"torch.optim {name}, foreach"
    mixed_label = f"mixedopt {name}"
    print(f"| threads | {torch_label} (it/s) | {mixed_label} (it/s) | time ratio |")
    print("|---:|---:|---:|---:|")
    notes = []
    for count in args.threads:
        results, not_finite = measure(
            pair,
            count,
            args.layers,
            args.width,
            args.batch,
            args.iterations,
            args.warmup,
            args.rounds,
            args.device,
        )
        theirs, ours = results["torch"], results["mixedopt"]
        ratio = "–"
        if theirs.median is not None and ours.median is not None:
            ratio = f"{theirs.median / ours.median:.2f}x"
        print(f"| {count} | {_cell(theirs)} | {_cell(ours)} | {ratio} |", flush=True)
        for library, result in results.items():
            if result.error:
                notes.append(f"error: {count} thread(s), {library}: {result.error}")
        if not_finite:
            threads = ", ".join(str(i) for i in not_finite)
            notes.append(
                f"warning: {count} thread(s): weights not finite in the mixedopt model(s) of "
                f"thread(s) {threads} (0-based)"
            )
    print()
    print(
        "it/s: iterations per second of all threads together (median over the rounds); "
        "time ratio: mixedopt's time per iteration over torch.optim's, lower is faster."
    )
    for note in notes:
        print(note)
    return 1 if any(note.startswith("error:") for note in notes) else 0


if __name__ == "__main__":
    raise SystemExit(main())

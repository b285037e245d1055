"""``python -m mixedopt.bench``: optimizer step time and memory, torch.optim next to mixedopt.

For every optimizer (RMSprop, Adam, AdamW, SGD with momentum 0.9) and every variant

* ``torch-foreach``: ``torch.optim.X(foreach=True)`` on float32 gradients,
* ``torch-fused``: ``torch.optim.X(fused=True)`` on float32 gradients, where torch has it,
* ``mixedopt``: ``mixedopt.X`` with its defaults (float16 gradients),
* ``mixedopt-fused``: ``mixedopt.X(fused=True)``,

the benchmark builds ``--params`` float32 parameters of ``--numel`` elements, gives them their
gradients through a real ``backward()`` (so that mixedopt stores them the way it does in training:
float16 with a power-of-two scale), and times ``step()`` alone: the gradients are kept across
steps, nothing is zeroed. Every variant gets fresh parameters with the same values. The variants
of one optimizer are timed in turn, one step each per round, so that the machine slowing down or
speeding up while they run changes all of them alike (their ratios are what the table is for);
each round starts with the next variant (``small.in_turn``).
A variant whose construction or step raises is shown as unavailable, with the first line of the
error as the reason; warnings raised by its steps go to the note column.

Columns
    * median step time over ``--repeat`` steps that follow the first step (which creates the
      state and is timed on its own) and ``--warmup`` more steps (also timed, into the JSON
      file; a warm-up step far slower than the first step and the median, a late recompilation
      say, is named in the note column). Where ``torch.compile`` compiled a graph during the
      first step or a warm-up step, that step's time is shown beside the first step's as
      ``compile`` (``compiles`` when it was the first step itself). ``mixedopt-fused``
      compiles in its second step, as its first one runs the default path to create the state
      (every optimizer here has state: SGD runs with momentum 0.9), and only for RMSprop or
      where ``--numel`` is above 32Ki elements on a CPU (1Mi on an accelerator): Adam, AdamW
      and SGD hand smaller parameters to torch's own fused update, which compiles nothing;
      the ratio to the ``torch-foreach`` row of the same optimizer;
    * persistent bytes per parameter: the ``nbytes`` of the weights, the gradients and every
      tensor in the optimizer state (0-dim step counters included), over the number of elements;
    * peak extra memory of one step once the state exists (``mixedopt.bench.memory`` says
      how it is measured);
    * achieved GB/s: the bytes a step has to move at the very least (per element: read the
      gradient, 2 B in float16 or 4 B in float32; read and write the weight, 8 B; read and write
      each state tensor, 8 B each) over the median time, and that as a fraction of the stream
      bandwidth measured at the start of the run: the median time of ``x.add_(1)`` on a float32
      tensor of ``--stream-mib`` MiB, counted as 2 x its size (read and write). An optimizer
      updates its tensors in place, and so does this reference. ``torch.add(x, 1, out=y)`` (the
      STREAM "add" shape, 2 x nbytes) is measured too and written to the JSON file: on CPU it is
      slower, since writing ``y`` also reads it into the cache first, and would put in-place
      updates above 100%. A step can still exceed 100% when its tensors fit in the caches.

Then the medium-tensors regime, a training iteration of an MLP 256-512-512-512-10 with its
forward and backward, and its step, timed apart (``mixedopt.bench.medium``; ``--no-medium``
leaves it out).

After the tables, the kernel launches and host synchronisations of the accelerator path,
counted on meta parameters for small and large ``Linear`` layers (``mixedopt.bench.launches``;
``--no-launches`` leaves them out): what a GPU pays per parameter, counted on any machine.

On a CPU shared with other busy processes, torch's worker threads wait on one another at
every operation and step times can grow tenfold; ``--threads 1`` gives steadier numbers there.

Stages
    This module is the command line; the stages are modules of their own: ``setup``
    (what is compared, building a variant), ``timing`` (the timed steps and iterations,
    the stream bandwidth), ``memory`` (peak memory; on CPU in a child process, which is
    ``python -m mixedopt.bench`` run with a hidden flag) and ``format`` (the tables).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from . import launches, medium, small
from .format import format_iteration, format_table, machine_info
from .memory import CHILD_FLAG, child_memory, measure_memory_in_child
from .setup import BASELINE, DEFAULT_OPTIMIZERS, OPTIMIZERS, VARIANTS, Row, positive
from .timing import ITERATION_VARIANTS, iteration_benchmark, run_optimizer, stream_bandwidth


def _choices(known: Sequence[str], what: str) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        names = [name.strip().lower() for name in text.split(",") if name.strip()]
        if not names:
            raise argparse.ArgumentTypeError(f"give at least one {what}")
        for name in names:
            if name not in known:
                raise argparse.ArgumentTypeError(
                    f"unknown {what} {name!r}; choose from {', '.join(known)}"
                )
        return list(dict.fromkeys(names))

    return parse


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Read the command line."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench",
        description="Time optimizer steps and measure their memory: torch.optim (foreach, fused) "
        "next to mixedopt, on the same parameters and gradients.",
    )
    parser.add_argument(
        "--numel", type=positive, default=2_000_000, help="elements per parameter (2_000_000)"
    )
    parser.add_argument("--params", type=positive, default=16, help="parameters (default 16)")
    parser.add_argument(
        "--optimizers",
        type=_choices(list(OPTIMIZERS), "optimizer"),
        default=DEFAULT_OPTIMIZERS,
        help=f"comma-separated, from {','.join(OPTIMIZERS)} "
        f"(default: {','.join(DEFAULT_OPTIMIZERS)})",
    )
    parser.add_argument(
        "--variants",
        type=_choices(list(VARIANTS), "variant"),
        default=list(VARIANTS),
        help=f"comma-separated, from {','.join(VARIANTS)} (default: all)",
    )
    parser.add_argument(
        "--device",
        choices=["cpu", "cuda"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="default: cuda when available",
    )
    parser.add_argument(
        "--repeat", type=positive, default=20, help="timed steps per variant (default 20)"
    )
    parser.add_argument(
        "--warmup",
        type=_non_negative,
        default=3,
        help="untimed steps after the first one (default 3)",
    )
    parser.add_argument(
        "--stream-mib",
        type=positive,
        default=256,
        help="size of the tensor of the stream-bandwidth measurement (default 256)",
    )
    parser.add_argument(
        "--threads",
        type=positive,
        default=None,
        help="CPU threads for torch (default: torch's own choice)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write every row and machine info")
    parser.add_argument(
        "--no-memory",
        dest="memory",
        action="store_false",
        help="skip the peak-memory measurement (on CPU: one child process per variant)",
    )
    parser.add_argument(
        "--no-iteration",
        dest="iteration",
        action="store_false",
        help="skip the training-iteration benchmark (4-layer MLP, AdamW)",
    )
    parser.add_argument(
        "--no-small",
        dest="small",
        action="store_false",
        help="skip the many-small-parameters regime (64 x Linear(64, 64): dispatched operations "
        "per backward and per step, iteration times over 5 x --repeat iterations, 100 at "
        "least; see mixedopt.bench.small)",
    )
    parser.add_argument(
        "--no-medium",
        dest="medium",
        action="store_false",
        help="skip the medium-tensors regime (an MLP 256-512-512-512-10, AdamW, batch 128: "
        "forward and backward, and the step, timed apart over 5 x --repeat iterations, 100 at "
        "least; see mixedopt.bench.medium)",
    )
    parser.add_argument(
        "--no-launches",
        dest="launches",
        action="store_false",
        help="skip the kernel launches of the accelerator path, counted on meta parameters "
        "(small and large Linear layers; see mixedopt.bench.launches)",
    )
    parser.add_argument(
        "--mlp-width", type=positive, default=1024, help="MLP width for the iteration (1024)"
    )
    parser.add_argument(
        "--mlp-batch", type=positive, default=64, help="batch size for the iteration (64)"
    )
    parser.add_argument(CHILD_FLAG, dest="memory_child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda was asked for, but CUDA is not available")
    return args


class Progress:
    """Where a long run is, on stderr: a tqdm bar where tqdm is installed, else a line per run.

    tqdm is optional (the ``dev`` extra installs it); without it each run prints, as it
    begins, ``bench: run 3/20: rmsprop, mixedopt fused: set-up, first and warm-up steps``,
    flushed, and :meth:`close` prints how many runs took how long. :meth:`write` prints results
    to stdout without breaking a bar.
    """

    def __init__(self, total: int) -> None:
        self.total = total
        self.begun = 0
        self.started = time.perf_counter()
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, file=sys.stderr, unit="run", leave=False)

    def __call__(self, label: str) -> None:
        """The run called ``label`` begins (and the one before, if any, has ended)."""
        if self.bar is not None:
            if self.begun:
                self.bar.update()
            self.bar.set_description_str(label)
        else:
            print(f"bench: run {self.begun + 1}/{self.total}: {label}", file=sys.stderr, flush=True)
        self.begun += 1

    def write(self, text: str = "") -> None:
        """Print ``text`` to stdout."""
        if self.bar is not None:
            self.bar.write(text, file=sys.stdout)
        else:
            print(text, flush=True)

    def close(self, finished: bool = True) -> None:
        """The last run has ended (``finished``), or an error stopped them."""
        if self.bar is not None:
            if self.begun and finished:
                self.bar.update()
            self.bar.close()
        elif finished:
            seconds = time.perf_counter() - self.started
            print(f"bench: {self.begun} runs done in {seconds:.0f} s", file=sys.stderr, flush=True)


def _run_count(args: argparse.Namespace, children: bool) -> int:
    """The runs ``_run`` tells its progress of (see there)."""
    pairs = len(args.optimizers) * len(args.variants)
    count = 1 + pairs + len(args.optimizers)  # stream bandwidth; per variant; timed rounds
    if children:
        count += pairs
    if args.iteration:
        count += len(ITERATION_VARIANTS) + 1
    if args.small:
        count += 1
    if args.medium:
        count += 1
    if args.launches:
        count += 1
    return count


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark, print the table; return the exit status."""
    args = parse_args(argv)
    threads = torch.get_num_threads()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    try:
        if args.memory_child is not None:
            print(json.dumps(child_memory(json.loads(args.memory_child))))
            return 0
        return _run(args)
    finally:
        torch.set_num_threads(threads)


def _run(args: argparse.Namespace) -> int:
    """Every measurement, its progress on stderr as it goes, the tables on stdout."""
    device = torch.device(args.device)
    children = args.memory and device.type == "cpu"
    progress = Progress(_run_count(args, children))
    try:
        status = _measure_and_print(args, device, children, progress)
    except BaseException:
        progress.close(finished=False)
        raise
    progress.close()
    return status


def _measure_and_print(
    args: argparse.Namespace, device: torch.device, children: bool, progress: Progress
) -> int:
    out = progress.write
    started = time.perf_counter()
    progress("stream bandwidth")
    streams = stream_bandwidth(device, args.stream_mib)
    stream = streams["inplace"]
    rows = []
    for optimizer in args.optimizers:
        rows += run_optimizer(args, optimizer, args.variants, progress)
    if children:
        for row in rows:
            label = f"{row.optimizer}, {VARIANTS[row.variant]}: peak memory"
            if not row.available:
                progress(f"{label}: none, unavailable")
                continue
            progress(f"{label}, in a child process")
            spec = {
                "optimizer": row.optimizer,
                "variant": row.variant,
                "numel": args.numel,
                "params": args.params,
                "warmup": args.warmup,
            }
            _apply_memory(row, measure_memory_in_child(spec, torch.get_num_threads()))
    elapsed = time.perf_counter() - started

    elements = args.numel * args.params
    baseline = {r.optimizer: r.median_ms for r in rows if r.variant == BASELINE and r.median_ms}
    for row in rows:
        if row.median_ms is None:
            continue
        if row.optimizer in baseline:
            row.ratio_to_foreach = row.median_ms / baseline[row.optimizer]
        if row.achieved_gbps is not None:
            row.stream_fraction = row.achieved_gbps * 1e9 / stream
        if row.peak_extra_bytes is not None:
            row.peak_extra_bytes_per_param = row.peak_extra_bytes / elements

    info = machine_info(device, streams, args.stream_mib)
    out(
        f"device {device} ({info['device_name']}, {info['torch_threads']} thread(s)) | "
        f"torch {torch.__version__} | {args.params} params x {args.numel:,} elements "
        f"= {elements:,} | stream bandwidth {stream / 1e9:.1f} GB/s "
        f"(x.add_(1) on {args.stream_mib} MiB float32) | median of {args.repeat} steps after "
        f"1 + {args.warmup} untimed | {elapsed:.0f} s"
    )
    out()
    out(format_table(rows))
    iteration = []
    if args.iteration:
        iteration = iteration_benchmark(
            device, args.mlp_width, 4, args.mlp_batch, args.repeat, args.warmup, progress
        )
        out()
        out(
            f"Training iteration (autocast float16 forward, backward, step, zero_grad) of a "
            f"4-layer {args.mlp_width}-wide MLP, batch {args.mlp_batch}, median of "
            f"{args.repeat} (page faults: mean per timed iteration):"
        )
        out()
        out(format_iteration(iteration))
    small_figures: dict[str, Any] = {}
    if args.small:
        # Iterations of a few milliseconds: more of them than of the large steps.
        small_repeat = max(5 * args.repeat, 100)
        progress(
            f"many small parameters: operation counts, then {small_repeat} iterations of each "
            f"of {len(small.PAIRS)} optimizer pairs"
        )
        text, small_figures = small.report(repeat=small_repeat, device=args.device)
        out()
        out("Many small parameters: mixedopt next to torch.optim (ratios: lower is faster)")
        out()
        out(text)
    medium_figures: dict[str, Any] = {}
    if args.medium:
        medium_repeat = max(5 * args.repeat, 100)
        progress(
            f"medium tensors: {medium_repeat} iterations of each of {2 * len(medium.PAIRS)} "
            "optimizers, in turn"
        )
        text, medium_figures = medium.report(repeat=medium_repeat, device=args.device)
        out()
        out("Medium tensors: mixedopt next to torch.optim (ratios: lower is faster)")
        out()
        out(text)
    launch_rows: list[dict[str, Any]] = []
    if args.launches:
        progress("kernel launches of the accelerator path, counted on meta parameters")
        counted = launches.launch_table()
        launch_rows = [asdict(row) for row in counted]
        out()
        out(launches.format_launch_table(counted))
    if args.json:
        document = {
            "machine": info,
            "config": {
                "numel": args.numel,
                "params": args.params,
                "optimizers": args.optimizers,
                "variants": args.variants,
                "repeat": args.repeat,
                "warmup": args.warmup,
                "memory": args.memory,
                "elapsed_s": elapsed,
            },
            "rows": [asdict(row) for row in rows],
            "iteration": iteration,
            "small": small_figures,
            "medium": medium_figures,
            "launches": launch_rows,
        }
        Path(args.json).write_text(json.dumps(document, indent=2) + "\n")
    return 0


def _apply_memory(row: Row, result: dict[str, Any]) -> None:
    if "error" in result:
        row.peak_error = result["error"]
        return
    row.peak_method = result["method"]
    row.peak_extra_bytes = result.get("peak_extra_bytes")
    row.peak_extra_upper_bound = result.get("peak_extra_upper_bound")


if __name__ == "__main__":
    raise SystemExit(main())

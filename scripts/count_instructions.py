"""Instructions an iteration of many small parameters executes, torch.optim next to mixedopt.

Times on a shared CPU scatter by 10-30%; instruction counts do not. This runs the per-op regime
of ``mixedopt.bench.small`` (64 x Linear(64, 64), batch 16, autocast(float16), one thread) under
``valgrind --tool=callgrind`` and prints, per iteration, the instructions of the whole
iteration, of ``backward()`` and of ``step()``, and, for mixedopt, of the two parts of its
backward: the storage hooks (``PyFunctionPreHook``, one Python call per parameter) and the
stores of the buckets (the callback queued at the end of backward). Each figure is its own run
of a child process: three warm-up iterations uninstrumented, then ``--iterations`` counted.
Switching the instrumentation on and off is counted too (the same few thousand instructions
on both sides). Needs valgrind (``apt install valgrind``); each run takes about 40 s.

``--floor`` (SGD) adds two columns: the minimal store of ``scripts/floor_small.py`` without and
with mixedopt's scales, for the iteration, backward and step: what part of mixedopt's
instructions any 16-bit store executes.

    python scripts/count_instructions.py [--optimizer sgd|adamw|rmsprop] [--iterations 4]
                                         [--floor]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from typing import Any

# What a count covers: (part of the iteration collected, valgrind functions it is limited to).
PARTS = {
    "iteration": ("iteration", None),
    "backward": ("backward", None),
    "step": ("step", None),
    "storage hooks": ("backward", "*PyFunctionPreHook*"),
    "bucket stores": ("backward", "*THPEngine_queue_callback*"),
}
# The variants of ``scripts/floor_small.py`` that ``--floor`` counts too (SGD only).
FLOOR = ("minimal store", "minimal store + scales")


def child(library: str, optimizer: str, part: str, iterations: int) -> None:
    """The measured process: warm up, then switch callgrind's instrumentation on around ``part``."""
    import torch

    import mixedopt
    from mixedopt.bench import small

    torch.set_num_threads(1)
    net = small.model(64, 64)
    params = net.parameters()
    if library in FLOOR:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from floor_small import MinimalStore

        make: dict[str, Callable[[], Any]] = {
            "sgd": lambda: MinimalStore(params, scaled=library == "minimal store + scales")
        }
    elif library == "torch":
        make = {
            "sgd": lambda: torch.optim.SGD(params, lr=1e-3, momentum=0.9, foreach=True),
            "adamw": lambda: torch.optim.AdamW(params, foreach=True),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=1e-3, foreach=True),
        }
    else:
        make = {
            "sgd": lambda: mixedopt.SGD(params, lr=1e-3, momentum=0.9),
            "adamw": lambda: mixedopt.AdamW(params),
            "rmsprop": lambda: mixedopt.RMSprop(params, lr=1e-3),
        }
    opt = make[optimizer]()
    x = torch.randn(16, 64)

    def loss() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.float16):
            return net(x).float().square().mean()

    def instrument(on: bool) -> None:
        flag = "on" if on else "off"
        subprocess.run(["callgrind_control", "-i", flag, str(os.getpid())], capture_output=True)

    for _ in range(3):
        loss().backward()
        opt.step()
        opt.zero_grad()
    for _ in range(iterations):
        if part == "iteration":
            instrument(True)
        value = loss()
        if part == "backward":
            instrument(True)
        value.backward()
        if part == "backward":
            instrument(False)
        if part == "step":
            instrument(True)
        opt.step()
        if part == "step":
            instrument(False)
        opt.zero_grad()
        if part == "iteration":
            instrument(False)


def count(library: str, optimizer: str, name: str, iterations: int) -> int:
    """Instructions per iteration of ``name`` (a key of ``PARTS``)."""
    part, function = PARTS[name]
    with tempfile.TemporaryDirectory() as directory:
        command = [
            "valgrind",
            "--tool=callgrind",
            "--instr-atstart=no",
            f"--callgrind-out-file={os.path.join(directory, 'out')}",
        ]
        if function is not None:
            command.append(f"--toggle-collect={function}")
        command += [sys.executable, __file__, "--child", library, optimizer, part, str(iterations)]
        result = subprocess.run(command, capture_output=True, text=True, check=True)
    found = re.search(r"Collected : (\d+)", result.stderr)
    if found is None:
        raise RuntimeError(f"no count in valgrind's output:\n{result.stderr[-2000:]}")
    return int(found.group(1)) // iterations


def main() -> None:
    """Count every part for both libraries and print a table."""
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        library, optimizer, part, iterations = sys.argv[2:6]
        child(library, optimizer, part, int(iterations))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--optimizer", choices=["sgd", "adamw", "rmsprop"], default="sgd")
    parser.add_argument("--iterations", type=int, default=4)
    parser.add_argument(
        "--floor", action="store_true", help="count the minimal stores of floor_small.py too (SGD)"
    )
    args = parser.parse_args()
    if args.floor and args.optimizer != "sgd":
        parser.error("--floor counts SGD with momentum only")
    print(
        f"64 x Linear(64, 64), {args.optimizer}, one thread: millions of instructions per "
        "iteration (valgrind --tool=callgrind)\n"
    )
    floor = FLOOR if args.floor else ()
    print(
        "| part | torch.optim | "
        + "".join(f"{name} | " for name in floor)
        + "mixedopt | difference |"
    )
    print("|---|---:|" + "---:|" * len(floor) + "---:|---:|")
    for name in PARTS:
        ours = count("mixedopt", args.optimizer, name, args.iterations)
        if PARTS[name][1] is None:
            theirs = count("torch", args.optimizer, name, args.iterations)
            between = [count(variant, args.optimizer, name, args.iterations) for variant in floor]
            cells = [theirs, *between, ours]
            row = " | ".join(f"{c / 1e6:.2f}" for c in cells) + f" | {(ours - theirs) / 1e6:+.2f}"
        else:
            row = "– | " * (1 + len(floor)) + f"{ours / 1e6:.2f} | –"
        print(f"| {name} | {row} |", flush=True)


if __name__ == "__main__":
    main()

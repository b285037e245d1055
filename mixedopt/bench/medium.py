"""The medium-tensors regime: a 4-layer MLP 256-512-512-512-10, AdamW, batch 128.

Between the regime where bytes decide (16 parameters of 2M elements) and the one where
dispatched operations decide (64 x ``Linear(64, 64)``) lies most of a real model: a few tensors
of 100K-1M elements each (BERT-base's 768 x 768). This MLP has eight tensors, 662K parameters:
three weights above the bucket limit (32Ki elements on a CPU), each stored alone in backward,
and a small weight and the biases that share a bucket.

A training iteration (forward under ``autocast(float16)`` and backward, ``step()``,
``zero_grad()``), with forward and backward, and the step, timed apart, and the minor page faults
of the whole iteration counted (a page fault maps 4 KiB of memory the C library had handed back
to the system, and a few hundred of them are a large part of this iteration on a CPU). Each pair
compares mixedopt with torch.optim: the default step against ``foreach=True``, ``fused=True``
against torch's fused step; a third pair runs mixedopt's forward under ``mixedopt.autocast``
(whose large weights get their float16 gradients as the matrix products make them). The
optimizers' iterations take turns (``small.in_turn``), so that the machine's drift reaches
them alike. Ratios are mixedopt's over torch.optim's: lower is faster.

``python -m mixedopt.bench`` prints it (``--no-medium`` leaves it out).
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import mixedopt

from . import small
from .small import in_turn

WIDTHS = (256, 512, 512, 512, 10)
BATCH = 128
# The small regime's AdamW pairs (torch.optim optimizer, mixedopt optimizer), by name; the last
# runs mixedopt's forward under ``mixedopt.autocast`` (``FORWARD``).
PAIRS = {name: small.PAIRS[name] for name in ("AdamW, default vs foreach", "AdamW, fused vs fused")}
PAIRS["AdamW, default vs foreach, mixedopt.autocast"] = PAIRS["AdamW, default vs foreach"]
# The forward's region of mixedopt's optimizer where it is not ``torch.autocast``
# (torch.optim's forward always runs under ``torch.autocast``).
FORWARD: dict[str, Callable[..., Any]] = {
    "AdamW, default vs foreach, mixedopt.autocast": mixedopt.autocast
}
PARTS = ("fwd+bwd", "step", "iteration")


def model(seed: int = 0, device: str = "cpu") -> nn.Sequential:
    """The MLP, ``Linear`` layers of ``WIDTHS`` with ReLU between them, the same for a seed."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for width_in, width_out in itertools.pairwise(WIDTHS):
        layers += [nn.Linear(width_in, width_out), nn.ReLU()]
    return nn.Sequential(*layers[:-1]).to(device)


def _minor_faults() -> int | None:
    """Minor page faults of this process so far (``None`` where the system does not count them)."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


class _Run:
    """One optimizer on its own copy of the model: its timed iterations."""

    def __init__(
        self,
        make: Callable[[Any], Any],
        x: torch.Tensor,
        y: torch.Tensor,
        device: str,
        region: Callable[..., Any] = torch.autocast,
    ) -> None:
        self.model = model(device=device)
        self.region = region
        self.opt = make(self.model.parameters())
        self.x, self.y = x, y
        self.sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
        self.times: dict[str, list[float]] = {part: [] for part in PARTS}
        self.faults: list[int] = []

    def iteration(self) -> None:
        before = _minor_faults()
        self.sync()
        start = time.perf_counter()
        with self.region(self.x.device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(self.model(self.x), self.y)
        loss.backward()
        self.sync()
        before_step = time.perf_counter()
        self.opt.step()
        self.sync()
        after_step = time.perf_counter()
        self.opt.zero_grad()
        self.sync()
        end = time.perf_counter()
        after = _minor_faults()
        self.times["fwd+bwd"].append(before_step - start)
        self.times["step"].append(after_step - before_step)
        self.times["iteration"].append(end - start)
        if before is not None and after is not None:
            self.faults.append(after - before)

    def clear(self) -> None:
        for values in self.times.values():
            values.clear()
        self.faults.clear()

    def medians(self) -> dict[str, float]:
        """Median milliseconds of each part, and the mean page faults of an iteration."""
        found = {part: 1e3 * statistics.median(values) for part, values in self.times.items()}
        found["page faults"] = statistics.mean(self.faults) if self.faults else float("nan")
        return found

    def close(self) -> None:
        """Give the gradients back (a mixedopt optimizer lets go of its parameters)."""
        self.opt.zero_grad()
        if hasattr(self.opt, "remove_grad_storage"):
            self.opt.remove_grad_storage()


def time_in_turns(
    makers: Sequence[tuple[Callable[[Any], Any], Callable[..., Any]]],
    repeat: int = 100,
    warmup: int = 5,
    device: str = "cpu",
) -> list[tuple[nn.Module, dict[str, float]]]:
    """Each ``(make, region)``'s optimizer on its own ``model`` (the same for all), in turns.

    ``make(params)`` makes the optimizer; ``region`` is the forward's autocast context
    (``torch.autocast`` or ``mixedopt.autocast``). Each runs its ``warmup`` iterations (two
    more: a fused step that compiles does so in the first two), then the timed iterations go
    round all of them. For each, its model after the iterations, and the median milliseconds
    of each of ``PARTS`` with the mean page faults of an iteration (``"page faults"``).
    """
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(BATCH, WIDTHS[0], generator=generator).to(device)
    y = torch.randint(0, WIDTHS[-1], (BATCH,), generator=generator).to(device)
    runs: list[_Run] = []
    try:
        for make, region in makers:
            run = _Run(make, x, y, device, region)
            runs.append(run)
            for _ in range(warmup + 2):
                run.iteration()
            run.clear()
        for round_index in range(repeat):
            for run in in_turn(runs, round_index):
                run.iteration()
        return [(run.model, run.medians()) for run in runs]
    finally:
        for run in runs:
            run.close()


def iteration_times(
    pairs: Sequence[str] = tuple(PAIRS), repeat: int = 100, warmup: int = 5, device: str = "cpu"
) -> dict[str, dict[str, dict[str, float]]]:
    """Per pair and library (``torch``, ``mixedopt``), the medians of ``repeat`` iterations.

    Every optimizer of every pair runs on its own model, in turns (``time_in_turns``).
    """
    keys: list[tuple[str, str]] = []
    makers: list[tuple[Callable[[Any], Any], Callable[..., Any]]] = []
    for pair in pairs:
        torch_make, mixedopt_make = PAIRS[pair]
        keys += [(pair, "torch"), (pair, "mixedopt")]
        makers += [(torch_make, torch.autocast), (mixedopt_make, FORWARD.get(pair, torch.autocast))]
    timed = time_in_turns(makers, repeat=repeat, warmup=warmup, device=device)
    found: dict[str, dict[str, dict[str, float]]] = {}
    for (pair, library), (_, medians) in zip(keys, timed, strict=True):
        found.setdefault(pair, {})[library] = medians
    return found


def report(
    repeat: int = 100, device: str = "cpu", pairs: Sequence[str] = tuple(PAIRS)
) -> tuple[str, dict[str, Any]]:
    """The regime's table as text, and its figures."""
    times = iteration_times(pairs, repeat=repeat, device=device)
    lines = [
        f"Training iteration of an MLP {'-'.join(map(str, WIDTHS))} (8 tensors, 662K "
        f"parameters), batch {BATCH}, autocast(float16), median of {repeat}, ms "
        "(mixedopt / torch.optim), and the page faults of an iteration (mean):",
        "",
        "| optimizers | fwd+bwd | step | iteration | page faults (mixedopt, torch) |",
        "|---|---:|---:|---:|---:|",
    ]
    for pair, medians in times.items():
        ours, theirs = medians["mixedopt"], medians["torch"]
        cells = [
            f"{ours[part]:.2f} / {theirs[part]:.2f} = {ours[part] / theirs[part]:.2f}x"
            for part in PARTS
        ]
        faults = f"{ours['page faults']:.0f}, {theirs['page faults']:.0f}"
        lines.append(f"| {pair} | " + " | ".join(cells) + f" | {faults} |")
    return "\n".join(lines), {"iteration_ms": times}

"""The timed runs of ``python -m mixedopt.bench``: optimizer steps and training iterations.

``run_optimizer`` times the steps of every variant of one optimizer, taking turns, and fills in
their rows; ``iteration_benchmark`` times a whole training iteration of an MLP per optimizer;
``stream_bandwidth`` is the memory bandwidth the achieved GB/s are compared with.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

import mixedopt

from .memory import cuda_peak, persistent_bytes
from .setup import VARIANTS, Row, Unavailable, build, first_line, teardown
from .small import in_turn

_QUIET_WARNINGS = (DeprecationWarning, PendingDeprecationWarning)


def full_state_tensors(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> int:
    """State tensors with as many elements as their parameter (what a step reads and writes)."""
    p = params[0]
    state = opt.state.get(p, {})
    return sum(1 for v in state.values() if torch.is_tensor(v) and v.numel() == p.numel())


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _count(n: int, thing: str) -> str:
    """``1 timed step``, ``2 timed steps``."""
    return f"{n} {thing}" if n == 1 else f"{n} {thing}s"


def _graphs_compiled() -> int | None:
    """Graphs ``torch.compile`` has compiled in this process so far (None: torch does not say)."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return int(counters["stats"]["unique_graphs"])


def timed(fn: Callable[[], Any], device: torch.device) -> float:
    """Seconds ``fn()`` takes, the device synchronised before and after."""
    _synchronize(device)
    start = time.perf_counter()
    fn()
    _synchronize(device)
    return time.perf_counter() - start


def _page_faults() -> int | None:
    """Minor page faults of this process so far (``None`` where the system does not count them).

    A page fault maps 4 KiB of memory the C library had handed back to the system: thousands of
    them in an iteration decide its time on a CPU, whichever optimizer allocates the memory.
    """
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def stream_bandwidth(device: torch.device, mib: int, repeat: int = 10) -> dict[str, float]:
    """Bytes per second of ``x.add_(1)`` and of ``torch.add(x, 1, out=y)``, 2 x nbytes each."""
    x = torch.ones(mib * 2**20 // 4, device=device)
    y = torch.empty_like(x)
    kernels = {"inplace": lambda: x.add_(1), "out": lambda: torch.add(x, 1, out=y)}
    found = {}
    for name, kernel in kernels.items():
        for _ in range(2):
            kernel()
        seconds = statistics.median(timed(kernel, device) for _ in range(repeat))
        found[name] = 2 * x.nbytes / seconds
    return found


# ---------------------------------------------------------------------------- one optimizer


class _Running:
    """One variant being timed: its row, parameters, optimizer and the warnings of its steps."""

    def __init__(self, row: Row, params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
        self.row, self.params, self.opt = row, params, opt
        self.caught: list[warnings.WarningMessage] = []
        self.compiled: list[bool] = []  # per step so far: whether torch.compile compiled in it

    def timed_step(self, device: torch.device) -> float:
        """Milliseconds of one ``step()``, its warnings kept for the note column."""
        before = _graphs_compiled()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ms = 1e3 * timed(self.opt.step, device)
        after = _graphs_compiled()
        self.compiled.append(before is not None and after is not None and after > before)
        self.caught += caught
        return ms


def run_optimizer(
    args: argparse.Namespace,
    optimizer: str,
    variants: Sequence[str],
    progress: Callable[[str], None] | None = None,
) -> list[Row]:
    """Time every variant of one optimizer in this process (and its CUDA peak, on CUDA).

    Each variant is built and takes its first and warm-up steps, one variant after the other;
    then the timed steps go round the variants, one step each per round, so that a change in the
    machine's speed while they run (other load, clock changes) reaches every variant alike
    instead of favouring the one timed first. ``progress`` is told of each of these
    ``len(variants) + 1`` runs as it begins.
    """
    device = torch.device(args.device)
    tell = progress or (lambda label: None)
    rows = [Row(optimizer, variant) for variant in variants]
    running: list[_Running] = []
    try:
        for row in rows:
            tell(f"{optimizer}, {VARIANTS[row.variant]}: set-up, first and warm-up steps")
            try:
                params, opt = build(optimizer, row.variant, args.numel, args.params, device)
            except Unavailable as why:
                row.available, row.reason = False, str(why)
                continue
            each = _Running(row, params, opt)
            running.append(each)
            try:
                row.first_step_ms = each.timed_step(device)
                row.warmup_ms = [each.timed_step(device) for _ in range(args.warmup)]
            except Exception as error:  # a variant that builds but cannot step: shown as such
                _drop_after_failed_step(running, each, error)
        tell(f"{optimizer}: {_count(args.repeat, 'timed step')} of each variant, in turn")
        for round_index in range(args.repeat):
            for each in in_turn(running, round_index):
                try:
                    each.row.step_ms.append(each.timed_step(device))
                except Exception as error:
                    _drop_after_failed_step(running, each, error)
        for each in running:
            _finish(args, each, device)
    finally:
        for each in running:
            teardown(each.params, each.opt)
        running.clear()
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _drop_after_failed_step(running: list[_Running], each: _Running, error: Exception) -> None:
    """Mark ``each`` unavailable (its row says why), free it and stop timing it."""
    running.remove(each)
    row = each.row
    row.available = False
    row.reason = f"step() raised {type(error).__name__}: {first_line(error)}"
    row.first_step_ms, row.warmup_ms, row.step_ms = None, [], []
    teardown(each.params, each.opt)


def _finish(args: argparse.Namespace, each: _Running, device: torch.device) -> None:
    """Fill in the row of a variant whose steps all ran."""
    row, params, opt = each.row, each.params, each.opt
    # Deprecation notices come from torch's own imports (torch.compile's, say): not the row's.
    found = [w for w in each.caught if not issubclass(w.category, _QUIET_WARNINGS)]
    row.warnings = list(dict.fromkeys(first_line(w.message) for w in found))
    # Which of the first and warm-up steps compiled, if any: mixedopt-fused's second one where
    # its kernels update a parameter (its first step creates the state on the default path).
    untimed = [row.first_step_ms, *row.warmup_ms]
    compiled = [i for i, done in enumerate(each.compiled[: len(untimed)]) if done]
    if compiled:
        row.compile_step = compiled[0] + 1
        row.first_step_compile_ms = untimed[compiled[0]]
    row.median_ms = statistics.median(row.step_ms)
    elements = args.numel * args.params
    row.persistent_bytes_per_param = persistent_bytes(params, opt) / elements
    grad = params[0].grad
    assert grad is not None
    row.grad_dtype = str(grad.dtype).removeprefix("torch.")
    row.state_tensors_per_param = full_state_tensors(params, opt)
    row.min_bytes_per_param = grad.element_size() + 8 + 8 * row.state_tensors_per_param
    row.achieved_gbps = row.min_bytes_per_param * elements / (row.median_ms / 1e3) / 1e9
    if device.type == "cuda" and args.memory:
        row.peak_extra_bytes = cuda_peak(opt, device)
        row.peak_method = "torch.cuda.max_memory_allocated"


# ---------------------------------------------------------------------------- a training iteration

ITERATION_VARIANTS = {
    "torch AdamW foreach": lambda params: torch.optim.AdamW(params, foreach=True),
    "mixedopt AdamW": lambda params: mixedopt.AdamW(params),
    "mixedopt AdamW fused": lambda params: mixedopt.AdamW(params, fused=True),
}


def iteration_benchmark(
    device: torch.device,
    width: int,
    layers: int,
    batch: int,
    repeat: int,
    warmup: int,
    progress: Callable[[str], None] | None = None,
) -> list[dict[str, Any]]:
    """Median time of a whole training iteration of an MLP, per optimizer.

    An iteration is what a training loop does: forward under ``autocast(float16)``, backward
    (where mixedopt's storage hooks run), ``step()`` and ``zero_grad()``. Every variant starts
    from the same weights and sees the same batch; their timed iterations take turns, as the
    steps of the main table do. Each result also has the mean page faults of its timed
    iterations (``_page_faults``). ``progress`` is told of each variant's warm-up and of the
    timed iterations (``len(ITERATION_VARIANTS) + 1`` runs) as they begin.
    """
    tell = progress or (lambda label: None)
    torch.manual_seed(0)
    template = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
    x = torch.randn(batch, width, device=device)
    iterations: dict[str, Callable[[], None]] = {}
    optimizers = []
    for name, make in ITERATION_VARIANTS.items():
        tell(f"training iteration, {name}: warm-up")
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]).to(device)
        model.load_state_dict(template.state_dict())
        opt = make(model.parameters())
        optimizers.append(opt)

        def iteration(model: nn.Module = model, opt: torch.optim.Optimizer = opt) -> None:
            with torch.autocast(device.type, dtype=torch.float16):
                loss = model(x).float().square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()

        # Two more: mixedopt's fused step compiles in its second step, where its kernels update
        # a parameter (a weight of more than 32Ki elements on a CPU, 1Mi on an accelerator).
        for _ in range(warmup + 2):
            iteration()
        iterations[name] = iteration
    tell(f"training iteration: {_count(repeat, 'timed iteration')} of each optimizer, in turn")
    times: dict[str, list[float]] = {name: [] for name in iterations}
    faults: dict[str, list[int]] = {name: [] for name in iterations}
    for round_index in range(repeat):
        for name, run in in_turn(list(iterations.items()), round_index):
            before = _page_faults()
            times[name].append(1e3 * timed(run, device))
            after = _page_faults()
            if before is not None and after is not None:
                faults[name].append(after - before)
    for opt in optimizers:
        if hasattr(opt, "remove_grad_storage"):
            opt.zero_grad()
            opt.remove_grad_storage()
    del optimizers, iterations
    gc.collect()
    results: list[dict[str, Any]] = [
        {
            "variant": name,
            "median_ms": statistics.median(ms),
            "ms": ms,
            "page_faults": statistics.mean(faults[name]) if faults[name] else None,
        }
        for name, ms in times.items()
    ]
    base = results[0]["median_ms"]
    for result in results:
        result["ratio"] = result["median_ms"] / base
    return results

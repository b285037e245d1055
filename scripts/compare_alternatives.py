"""Alternatives to mixedopt, side by side on one small training task (docs/alternatives.md).

Every variant trains the same MLP (blocks of Linear, LayerNorm, GELU) from the same initial
weights on the same fixed synthetic data (a seeded teacher network labels Gaussian inputs into
classes) with AdamW and the same hyperparameters, for the same number of steps, the forward
under ``torch.autocast("cpu", dtype=torch.float16)`` (``--autocast``), the loss multiplied by
``--loss-factor`` (1) before backward:

* ``torch.optim``: ``torch.optim.AdamW``, float32 gradients: the reference.
* ``torch.optim + GradScaler``: the same with ``torch.amp.GradScaler`` (float32 gradients).
* ``torch.optim grad_dtype=float16`` (with and without GradScaler): ``p.grad_dtype =
  torch.float16`` on each parameter, so that autograd stores float16 ``.grad``; stock AdamW
  and GradScaler refuse such gradients (the row shows the error).
* ``torch.optim grad_dtype=float16 + upcast``: the same, with each gradient upcast to float32
  just before ``step()`` (what a user of plain PyTorch can do): float16 between backward and
  step, float32 during it.
* ``mixedopt.AdamW`` and ``mixedopt.AdamW(fused=True)`` (``--fused``: compiles at its first
  step, seconds on a CPU).
* ``PyTorch optimizer in backward``: PyTorch's recipe, one ``torch.optim.AdamW`` per parameter
  stepped in a ``register_post_accumulate_grad_hook`` that then sets ``.grad`` to None.
* ``mixedopt step_in_backward()``: ``with optimizer.step_in_backward(): loss.backward()``.
* ``torch-optimi bfloat16 + Kahan``: ``optimi.AdamW`` on the model cast to bfloat16 (weights,
  gradients and state in bfloat16, Kahan summation of the updates); forward in bfloat16.
* ``torchao AdamW8bit`` / ``AdamW4bit``: torchao's AdamW with 8-bit / 4-bit block-quantized
  state (tensors of 4096 elements or more; smaller ones keep float32 state), float32 weights
  and gradients.

For each it prints the bytes per parameter held, the time ratios over the reference's, the final
loss and how far the weights ended from the reference's:

* bytes: measured in a fresh Python process per variant (``--memory-of``), after the backward
  of its third iteration, before its ``step()`` (the state of two steps exists, the gradients
  are held): every tensor storage alive there (tensors found by ``gc.get_objects()`` and the
  parameters, their ``.grad`` and the optimizers' state, the inner tensors of tensor subclasses
  such as torchao's), counted once each, less those alive before the model was built (the data).
  Split into weights (the parameters' storages), gradients (``.grad``'s), optimizer state and
  the rest (buffers a library keeps, whatever their size: not per parameter).
* times: the variants take turns of ``--block`` training iterations each, in an order shuffled
  at every round; the median of the iterations after ``--warmup``, less the first of each turn
  (it pays for the variant before it: caches, threads of compiled code still spinning), on
  one thread (``--threads``). ``step()`` is what follows backward (with ``zero_grad``); a
  variant that steps in backward has none.
* final loss: cross-entropy of the final weights over all training data, in float32.
* weight error: over the parameter tensors, the largest ``||w - w_ref|| / ||w_ref - w_0||``:
  the distance to the reference's final weights relative to the distance the reference moved.

torch-optimi and torchao are optional (``pip install -e '.[compare]'``); without them their
rows say so. Usage:

    python scripts/compare_alternatives.py [--steps 60] [--width 384] [--fused]
    python scripts/compare_alternatives.py --autocast none --loss-factor 1e-4  # small gradients
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import importlib
import importlib.metadata
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    import torch
from torch import Tensor, nn

import mixedopt

NOT_INSTALLED = "not installed: pip install -e '.[compare]'"
REFERENCE = "torch.optim"
LOAD_BEFORE = os.getloadavg()[0] if hasattr(os, "getloadavg") else math.nan


# --------------------------------------------------------------------------------------------
# The task


@dataclass(frozen=True)
class Task:
    """The training task every variant runs, built from the command line's settings."""

    features: int
    width: int
    depth: int
    classes: int
    batch: int
    batches: int
    steps: int
    warmup: int
    block: int
    lr: float
    weight_decay: float
    loss_factor: float
    autocast: str  # float16, bfloat16 or none
    seed: int

    @staticmethod
    def from_args(args: argparse.Namespace) -> Task:
        """The task the parsed command line describes."""
        return Task(
            features=args.features,
            width=args.width,
            depth=args.depth,
            classes=args.classes,
            batch=args.batch,
            batches=args.batches,
            steps=args.steps,
            warmup=args.warmup,
            block=args.block,
            lr=args.lr,
            weight_decay=args.weight_decay,
            loss_factor=args.loss_factor,
            autocast=args.autocast,
            seed=args.seed,
        )

    def data(self) -> tuple[Tensor, Tensor]:
        """Inputs (batches x batch x features) and labels a random teacher network gives them."""
        generator = torch.Generator().manual_seed(self.seed + 1)
        x = torch.randn(self.batches, self.batch, self.features, generator=generator)
        teacher_hidden = torch.randn(self.features, 64, generator=generator) / self.features**0.5
        teacher_out = torch.randn(64, self.classes, generator=generator) / 8
        labels = (torch.tanh(x @ teacher_hidden) @ teacher_out).argmax(-1)
        return x, labels

    def model(self) -> nn.Sequential:
        """The MLP, with the same initial weights at every call."""
        with torch.random.fork_rng():
            torch.manual_seed(self.seed)
            return self._model()

    def _model(self) -> nn.Sequential:
        layers: list[nn.Module] = []
        for i in range(self.depth - 1):
            inputs = self.features if i == 0 else self.width
            layers += [nn.Linear(inputs, self.width), nn.LayerNorm(self.width), nn.GELU()]
        layers.append(nn.Linear(self.width, self.classes))
        return nn.Sequential(*layers)

    def adamw_args(self) -> dict[str, Any]:
        """The AdamW hyperparameters every variant gets (torch.optim's defaults, but lr)."""
        wd = self.weight_decay
        return {"lr": self.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": wd}

    def describe(self) -> str:
        """One line for the report."""
        params = sum(p.numel() for p in self.model().parameters())
        forward = "in float32" if self.autocast == "none" else f"under autocast {self.autocast}"
        return (
            f"MLP {self.features} -> {self.width} x {self.depth - 1} -> {self.classes} "
            f"(Linear, LayerNorm, GELU), {params:,} parameters, AdamW(lr={self.lr}, "
            f"betas=(0.9, 0.999), eps=1e-8, weight_decay={self.weight_decay}), forward "
            f"{forward}, loss x {self.loss_factor:g}, {self.steps} steps over {self.batches} "
            f"fixed batches of {self.batch}, seed {self.seed}"
        )


# --------------------------------------------------------------------------------------------
# The variants


class Run:
    """One variant's model and optimizer: ``backward``, then ``step`` (with ``zero_grad``)."""

    def __init__(self, model: nn.Module, optimizers: Sequence[torch.optim.Optimizer]) -> None:
        self.model = model
        self.optimizers = list(optimizers)
        self.notes: list[str] = []
        self.loss_factor = 1.0  # the task's --loss-factor
        self.autocast: torch.dtype | None = torch.float16  # the task's --autocast

    def loss(self, x: Tensor, y: Tensor) -> Tensor:
        """The forward (under the task's autocast) and the loss, in float32."""
        if self.autocast is None:
            out = self.model(x)
        else:
            with torch.autocast("cpu", dtype=self.autocast):
                out = self.model(x)
        return nn.functional.cross_entropy(out.float(), y) * self.loss_factor

    def backward(self, loss: Tensor) -> None:
        """Backward (and, for some, the update)."""
        loss.backward()

    def step(self) -> None:
        """What follows backward: ``step()`` and ``zero_grad()``."""
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad()

    def float_model(self) -> nn.Module:
        """The model's weights in float32 (for the final loss and the weight error)."""
        return self.model

    def finish(self) -> None:
        """Add what the notes should say once training is over."""


class ScaledRun(Run):
    """torch.optim with GradScaler: counts the steps the scaler skipped."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, [optimizer])
        self.scaler = torch.amp.GradScaler("cpu")
        self.skipped = 0

    def backward(self, loss: Tensor) -> None:  # noqa: D102
        self.scaler.scale(loss).backward()

    def step(self) -> None:  # noqa: D102
        before = self.scaler.get_scale()
        self.scaler.step(self.optimizers[0])
        self.scaler.update()
        self.skipped += self.scaler.get_scale() < before
        self.optimizers[0].zero_grad()

    def finish(self) -> None:  # noqa: D102
        self.notes.append(f"GradScaler skipped {self.skipped} steps (inf/NaN at its scale)")


class UpcastRun(Run):
    """float16 ``.grad`` via ``Tensor.grad_dtype``, upcast to float32 just before ``step()``."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(model, [optimizer])
        for p in model.parameters():
            p.grad_dtype = torch.float16

    def step(self) -> None:  # noqa: D102
        params = [p for p in self.model.parameters() if p.grad is not None]
        for p in params:  # a float32 .grad may only be assigned once grad_dtype allows it
            grad = p.grad
            assert grad is not None
            p.grad = None
            p.grad_dtype = None
            p.grad = grad.float()
        self.optimizers[0].step()
        self.optimizers[0].zero_grad()
        for p in params:
            p.grad_dtype = torch.float16


class TorchInBackwardRun(Run):
    """PyTorch's recipe: an optimizer per parameter, stepped as soon as its gradient is ready."""

    def __init__(self, model: nn.Module, task: Task) -> None:
        per_param: dict[Tensor, torch.optim.Optimizer] = {
            p: torch.optim.AdamW([p], **task.adamw_args()) for p in model.parameters()
        }
        super().__init__(model, list(per_param.values()))

        def hook(param: Tensor) -> None:
            per_param[param].step()
            per_param[param].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)

    def step(self) -> None:  # noqa: D102
        pass


class MixedInBackwardRun(Run):
    """mixedopt: ``with optimizer.step_in_backward(): loss.backward()``."""

    def backward(self, loss: Tensor) -> None:  # noqa: D102
        with self.optimizers[0].step_in_backward():  # type: ignore[attr-defined]
            loss.backward()

    def step(self) -> None:  # noqa: D102
        pass


class Bfloat16Run(Run):
    """The model itself in bfloat16 (torch-optimi's low-precision training): forward in bfloat16."""

    def loss(self, x: Tensor, y: Tensor) -> Tensor:  # noqa: D102
        out = self.model(x.bfloat16()).float()
        return nn.functional.cross_entropy(out, y) * self.loss_factor

    def float_model(self) -> nn.Module:  # noqa: D102
        return copy.deepcopy(self.model).float()


@dataclass(frozen=True)
class Variant:
    """A row of the table: its name, what it is, and how to build its run on a fresh model."""

    name: str
    build: Callable[[nn.Module, Task], Run]
    needs: str | None = None  # an optional module it imports

    def run(self, task: Task) -> Run:
        """The variant's run on a fresh model of the task."""
        run = self.build(task.model(), task)
        run.loss_factor = task.loss_factor
        run.autocast = None if task.autocast == "none" else getattr(torch, task.autocast)
        return run

    def available(self) -> bool:
        """Whether the module it needs can be imported."""
        if self.needs is None:
            return True
        try:
            importlib.import_module(self.needs)
        except ImportError:
            return False
        return True


def _grad_dtype_float16(model: nn.Module, task: Task) -> Run:
    for p in model.parameters():
        p.grad_dtype = torch.float16
    return Run(model, [torch.optim.AdamW(model.parameters(), **task.adamw_args())])


def _grad_dtype_float16_scaled(model: nn.Module, task: Task) -> Run:
    for p in model.parameters():
        p.grad_dtype = torch.float16
    return ScaledRun(model, torch.optim.AdamW(model.parameters(), **task.adamw_args()))


def _optimi(model: nn.Module, task: Task) -> Run:
    import optimi  # type: ignore[import-not-found]

    model = model.bfloat16()
    optimizer = optimi.AdamW(model.parameters(), **task.adamw_args(), kahan_sum=True)
    return Bfloat16Run(model, [optimizer])


def _torchao(name: str) -> Callable[[nn.Module, Task], Run]:
    def build(model: nn.Module, task: Task) -> Run:
        import torchao.optim  # type: ignore[import-not-found]

        optimizer = getattr(torchao.optim, name)(model.parameters(), **task.adamw_args())
        return Run(model, [optimizer])

    return build


VARIANTS = [
    Variant(
        REFERENCE,
        lambda m, t: Run(m, [torch.optim.AdamW(m.parameters(), **t.adamw_args())]),
    ),
    Variant(
        "torch.optim + GradScaler",
        lambda m, t: ScaledRun(m, torch.optim.AdamW(m.parameters(), **t.adamw_args())),
    ),
    Variant("torch.optim grad_dtype=float16", _grad_dtype_float16),
    Variant("torch.optim grad_dtype=float16 + GradScaler", _grad_dtype_float16_scaled),
    Variant(
        "torch.optim grad_dtype=float16 + upcast",
        lambda m, t: UpcastRun(m, torch.optim.AdamW(m.parameters(), **t.adamw_args())),
    ),
    Variant(
        "mixedopt.AdamW",
        lambda m, t: Run(m, [mixedopt.AdamW(m.parameters(), **t.adamw_args())]),
    ),
    Variant(
        "mixedopt.AdamW(fused=True)",
        lambda m, t: Run(m, [mixedopt.AdamW(m.parameters(), **t.adamw_args(), fused=True)]),
    ),
    Variant("PyTorch optimizer in backward", TorchInBackwardRun),
    Variant(
        "mixedopt step_in_backward()",
        lambda m, t: MixedInBackwardRun(m, [mixedopt.AdamW(m.parameters(), **t.adamw_args())]),
    ),
    Variant("torch-optimi bfloat16 + Kahan", _optimi, needs="optimi"),
    Variant("torchao AdamW8bit", _torchao("AdamW8bit"), needs="torchao.optim"),
    Variant("torchao AdamW4bit", _torchao("AdamW4bit"), needs="torchao.optim"),
]
FUSED = "mixedopt.AdamW(fused=True)"


# --------------------------------------------------------------------------------------------
# Bytes held


def _plain(obj: object) -> Iterator[Tensor]:
    """The tensors with storage that ``obj`` is or holds (tensor subclasses: their inner ones)."""
    if isinstance(obj, Tensor):
        flatten = getattr(obj, "__tensor_flatten__", None)
        if flatten is not None and type(obj) not in (Tensor, nn.Parameter):
            names, _ = flatten()
            for name in names:
                yield from _plain(getattr(obj, name))
        elif type(obj) in (Tensor, nn.Parameter) and obj.layout == torch.strided:
            yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _plain(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _plain(value)


def _storages(tensors: Iterable[Tensor]) -> dict[int, int]:
    """Data pointer -> bytes of each CPU storage the tensors use."""
    found: dict[int, int] = {}
    for t in tensors:
        storage = t.untyped_storage()
        if storage.device.type == "cpu" and storage.data_ptr() != 0:
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _live_tensors() -> list[Tensor]:
    gc.collect()
    tensors: list[Tensor] = []
    with warnings.catch_warnings():  # isinstance() on deprecated torch objects warns
        warnings.simplefilter("ignore")
        for obj in gc.get_objects():
            if isinstance(obj, Tensor):
                tensors.extend(_plain(obj))
    return tensors


def bytes_held(variant: Variant, task: Task) -> dict[str, float]:
    """What the variant holds after its third backward, in bytes per parameter (in this process).

    Run it in a fresh process (``--memory-of``): buffers a library keeps for the whole process
    would otherwise be counted for whichever variant made them first.
    """
    x, y = task.data()
    before = _live_tensors()  # kept alive: their addresses cannot be reused meanwhile
    seen = set(_storages(before))
    run = variant.run(task)
    params = list(run.model.parameters())
    for i in range(3):
        loss = run.loss(x[i % task.batches], y[i % task.batches])
        run.backward(loss)
        if i < 2:
            run.step()
    weights = _storages(params)
    grads = _storages(p.grad for p in params if p.grad is not None)
    state = _storages(_plain([list(o.state.values()) for o in run.optimizers]))
    everything = _storages(_live_tensors())
    for part in (weights, grads, state):
        everything.update(part)
    del before
    counted: set[int] = set()
    numel = sum(p.numel() for p in params)

    def per_param(part: dict[int, int]) -> float:
        new = {ptr: n for ptr, n in part.items() if ptr not in counted and ptr not in seen}
        counted.update(new)
        return sum(new.values()) / numel

    held = {
        "weights": per_param(weights),
        "grads": per_param(grads),
        "state": per_param(state),
        "other": per_param(everything),
    }
    held["total"] = sum(held.values())
    held["params"] = numel
    return held


def bytes_in_fresh_process(name: str, argv: Sequence[str]) -> dict[str, float]:
    """``bytes_held`` of the variant ``name``, run by this script in a child process."""
    command = [sys.executable, __file__, *argv, "--memory-of", name]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"{command} failed:\n{done.stderr[-2000:]}")
    return json.loads(lines[-1])


# --------------------------------------------------------------------------------------------
# Training in turns


@dataclass
class Row:
    """What the table shows for one variant."""

    name: str
    status: str = "ok"  # or why it has no figures: not installed, or the error it raised
    held: dict[str, float] = field(default_factory=dict)
    step_ms: float | None = None  # None: no step() after backward (it steps in backward)
    iteration_ms: float = math.nan
    timed: int = 0  # iterations timed
    final_loss: float = math.nan
    weight_error: float = math.nan
    notes: list[str] = field(default_factory=list)
    step_ratio: float | None = None
    iteration_ratio: float = math.nan


def _error(error: BaseException) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return f"fails: {type(error).__name__}: {first}"


def _final_loss(model: nn.Module, x: Tensor, y: Tensor) -> float:
    with torch.no_grad():
        out = model(x.flatten(0, 1))
        return nn.functional.cross_entropy(out.float(), y.flatten()).item()


def _turns(
    runs: dict[str, Run],
    rows: dict[str, Row],
    task: Task,
    x: Tensor,
    y: Tensor,
    order: random.Random,
    step_times: dict[str, list[float]],
    iteration_times: dict[str, list[float]],
) -> None:
    """Train the runs in turns of ``task.block`` iterations; record the times."""
    for first in range(0, task.steps, task.block):
        names = list(runs)
        order.shuffle(names)  # no variant always runs after the same one
        for name in names:
            run = runs[name]
            for i in range(first, min(first + task.block, task.steps)):
                try:
                    start = time.perf_counter()
                    loss = run.loss(x[i % task.batches], y[i % task.batches])
                    run.backward(loss)
                    backward_done = time.perf_counter()
                    run.step()
                    end = time.perf_counter()
                except Exception as error:  # noqa: BLE001 - the row reports it
                    rows[name].status = _error(error)
                    del runs[name]
                    break
                # The first iteration of a turn pays for the variant before it (caches, and
                # the threads of compiled code still spinning): not timed.
                if i >= task.warmup and (i > first or task.block == 1):
                    step_times[name].append(end - backward_done)
                    iteration_times[name].append(end - start)


def _weight_errors(
    model: nn.Module, reference: nn.Module, initial: list[Tensor]
) -> dict[str, float]:
    """Per parameter tensor: distance to the reference's, over the distance the reference moved."""
    modules = dict(model.named_modules())
    errors = {}
    weights = zip(model.named_parameters(), reference.parameters(), initial, strict=True)
    for (name, p), r, p0 in weights:
        owner = type(modules[name.rpartition(".")[0]]).__name__
        moved = (r.detach() - p0).norm().item()
        errors[f"{name} ({owner})"] = (p.detach().float() - r.detach()).norm().item() / moved
    return errors


def train_in_turns(variants: Sequence[Variant], task: Task) -> list[Row]:
    """Train every variant ``task.steps`` steps, one iteration each in turn; fill in the rows."""
    x, y = task.data()
    initial = [p.detach().clone() for p in task.model().parameters()]
    rows = {v.name: Row(v.name) for v in variants}
    runs: dict[str, Run] = {}
    for v in variants:
        if not v.available():
            rows[v.name].status = NOT_INSTALLED
            continue
        try:
            runs[v.name] = v.run(task)
        except Exception as error:  # noqa: BLE001 - the row reports it
            rows[v.name].status = _error(error)
    step_times: dict[str, list[float]] = {name: [] for name in runs}
    iteration_times: dict[str, list[float]] = {name: [] for name in runs}
    in_backward = (TorchInBackwardRun, MixedInBackwardRun)
    steps_in_backward = {name for name, run in runs.items() if isinstance(run, in_backward)}
    order = random.Random(task.seed)
    gc.collect()
    gc.disable()  # as timeit does: a collection would land in whichever variant runs then
    try:
        _turns(runs, rows, task, x, y, order, step_times, iteration_times)
    finally:
        gc.enable()
    reference = runs.get(REFERENCE)
    for name, run in runs.items():
        run.finish()
        row = rows[name]
        row.notes += run.notes
        model = run.float_model()
        row.final_loss = _final_loss(model, x, y)
        if reference is not None:
            errors = _weight_errors(model, reference.float_model(), initial)
            row.weight_error = max(errors.values())
            if row.weight_error > 0:
                largest = max(errors, key=errors.__getitem__)
                row.notes.append(
                    f"weight error largest on {largest}, median over the "
                    f"{len(errors)} tensors {statistics.median(errors.values()):.2e}"
                )
        row.timed = len(iteration_times[name])
        if iteration_times[name]:
            row.iteration_ms = 1e3 * statistics.median(iteration_times[name])
            if name not in steps_in_backward:
                row.step_ms = 1e3 * statistics.median(step_times[name])
    if reference is not None and REFERENCE in rows:
        ref = rows[REFERENCE]
        for row in rows.values():
            row.iteration_ratio = row.iteration_ms / ref.iteration_ms
            if row.step_ms is not None and ref.step_ms:
                row.step_ratio = row.step_ms / ref.step_ms
    return [rows[v.name] for v in variants]


# --------------------------------------------------------------------------------------------
# The report


def _versions() -> str:
    names = ["torch", "mixedopt", "torch-optimi", "torchao"]
    found = []
    for name in names:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            found.append(f"{name} not installed")
    return ", ".join(found)


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _cell(value: float | None, fmt: str) -> str:
    if value is None:
        return "in backward"
    return "-" if math.isnan(value) else format(value, fmt)


def report(rows: Sequence[Row], task: Task, argv: Sequence[str]) -> str:
    """The header and the table, in Markdown."""
    command = " ".join(["python scripts/compare_alternatives.py", *argv])
    lines = [
        f"`{command.strip()}`:",
        "",
        f"- date: {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z}",
        f"- CPU: {_cpu()}, torch.set_num_threads({torch.get_num_threads()}); load average "
        f"before the run {LOAD_BEFORE:.2f} (other processes share the CPU: times move)",
        f"- {_versions()}",
        f"- task: {task.describe()}",
        "",
        "| variant | bytes/param held: weights + grads + state + other = total "
        "| step() ratio | iteration ratio | final loss | weight error |",
        "|---|---|---:|---:|---:|---:|",
    ]
    notes = []
    for row in rows:
        if row.status != "ok":
            lines.append(f"| {row.name} | {row.status} | | | | |")
            continue
        h = row.held
        held = (
            f"{h['weights']:.2f} + {h['grads']:.2f} + {h['state']:.2f} + {h['other']:.2f} "
            f"= {h['total']:.2f}"
            if h
            else "-"
        )
        step = _cell(row.step_ratio, ".2f")
        step = step if row.step_ratio is None else f"{step}x"
        lines.append(
            f"| {row.name} | {held} | {step} | {_cell(row.iteration_ratio, '.2f')}x "
            f"| {_cell(row.final_loss, '.6f')} | {_cell(row.weight_error, '.2e')} |"
        )
        notes += [f"- {row.name}: {note}" for note in row.notes]
        if h and h["other"] * h["params"] >= 1024:
            kib = h["other"] * h["params"] / 1024
            other = f"{kib:.1f} KiB" if kib < 1024 else f"{kib / 1024:.2f} MiB"
            notes.append(f"- {row.name}: other {other} in all")
    ref = next((r for r in rows if r.name == REFERENCE and r.status == "ok"), None)
    if ref is not None:
        lines += [
            "",
            f"- reference times: iteration {ref.iteration_ms:.2f} ms, step() {ref.step_ms:.2f} ms "
            f"(medians of {ref.timed} iterations; the first {task.warmup} not timed, the variants "
            f"taking turns of {task.block} iterations in a shuffled order, the first of each turn "
            "not timed)",
        ]
    lines += notes
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# The command line


def parser() -> argparse.ArgumentParser:
    """The command line's flags."""
    p = argparse.ArgumentParser(
        description="Alternatives to mixedopt side by side on one small training task: bytes "
        "per parameter held, time ratios, final loss and weight error against torch.optim. "
        "torch-optimi and torchao rows need pip install -e '.[compare]'.",
    )
    p.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    p.add_argument("--warmup", type=int, default=10, help="iterations not timed (default 10)")
    p.add_argument(
        "--block", type=int, default=4, help="iterations of a variant per turn (default 4)"
    )
    p.add_argument("--width", type=int, default=384, help="hidden width (default 384)")
    p.add_argument("--depth", type=int, default=4, help="Linear layers (default 4)")
    p.add_argument("--features", type=int, default=256, help="input features (default 256)")
    p.add_argument("--classes", type=int, default=10, help="classes (default 10)")
    p.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    p.add_argument("--batches", type=int, default=32, help="fixed batches of data (default 32)")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: on a shared machine, steadier than several)",
    )
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate (default 1e-3)")
    p.add_argument(
        "--weight-decay", type=float, default=1e-2, help="AdamW's weight_decay (default 1e-2)"
    )
    p.add_argument(
        "--loss-factor",
        type=float,
        default=1.0,
        help="multiply the loss by this before backward: small values make small gradients, "
        "as a loss averaged over many tokens or a long accumulation does (default 1)",
    )
    p.add_argument(
        "--autocast",
        choices=["float16", "bfloat16", "none"],
        default="float16",
        help="the forward's torch.autocast dtype, or none: float32 (default float16; "
        "torch-optimi's row runs its bfloat16 model without autocast whatever this says)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="of the data and the initial weights (default 0)"
    )
    p.add_argument(
        "--fused", action="store_true", help="add mixedopt.AdamW(fused=True) (compiles: slow)"
    )
    p.add_argument(
        "--variants",
        help="comma-separated names of the variants to run (default: all; the reference always)",
    )
    p.add_argument(
        "--no-memory", action="store_true", help="skip the bytes (one child process a variant)"
    )
    p.add_argument("--memory-of", help=argparse.SUPPRESS)  # internal: one variant's bytes
    return p


def chosen(args: argparse.Namespace) -> list[Variant]:
    """The variants the command line asks for, the reference first."""
    if args.variants:
        names = {REFERENCE, *(n.strip() for n in args.variants.split(","))}
        unknown = names - {v.name for v in VARIANTS}
        if unknown:
            known = [v.name for v in VARIANTS]
            raise SystemExit(f"unknown variants: {sorted(unknown)}; known: {known}")
        return [v for v in VARIANTS if v.name in names]
    return [v for v in VARIANTS if v.name != FUSED or args.fused]


def main(argv: Sequence[str] | None = None) -> list[Row]:
    """Run the comparison, print its table, return its rows."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    task = Task.from_args(args)
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        with warnings.catch_warnings():
            # torch.compile (torchao's step) warns about its tensor subclasses' cache keys.
            warnings.filterwarnings("ignore", category=UserWarning, module="torch._functorch")
            if args.memory_of:
                variant = next(v for v in VARIANTS if v.name == args.memory_of)
                print(json.dumps(bytes_held(variant, task)))
                return []
            rows = train_in_turns(chosen(args), task)
            if not args.no_memory:
                for row in rows:
                    if row.status == "ok":
                        row.held = bytes_in_fresh_process(row.name, argv)
            print(report(rows, task, argv))
            return rows
    finally:
        torch.set_num_threads(threads)


if __name__ == "__main__":
    main()

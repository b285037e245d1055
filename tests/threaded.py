"""Training runs of the thread tests, and running them on several threads at once.

Every model, optimizer and input is made before any thread starts (module initialisation and
``torch.manual_seed`` on several threads at once would race on the global random generator);
each thread then trains what it was given. A run in a thread of its own, alone, is the
reference: the same kind of thread as in the trials, with the same threading settings of torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

import mixedopt

OPTIMIZERS = {
    "RMSprop": (mixedopt.RMSprop, {"lr": 1e-2, "momentum": 0.9}),
    "Adam": (mixedopt.Adam, {"lr": 1e-2}),
    "AdamW": (mixedopt.AdamW, {"lr": 1e-2}),
    "SGD": (mixedopt.SGD, {"lr": 1e-2, "momentum": 0.9}),
}
# Largest weight of a bucket on a CPU is 32Ki elements (``_budget.CPU_SMALL``): the 192 x 192
# weight (36864) is stored alone, the others wait in a bucket.
WIDTHS = (16, 64, 64, 192, 192, 4)
BATCH = 8
STEPS = 4


@dataclasses.dataclass(frozen=True)
class Config:
    """What one training run is: optimizer, step, scaling and 16-bit dtype."""

    optimizer: str
    fused: bool = False
    scaling: str = "none"  # "none", "grad_scaler" or "max_grad_norm"
    dtype: torch.dtype = torch.float16  # autocast's, and the gradients'
    # The forward's region: "torch.autocast", or "mixedopt.autocast", whose casts hand the
    # storage their 16-bit gradients (the 192 x 192 weight's, stored alone).
    forward: str = "torch.autocast"

    def __str__(self) -> str:
        fused = ", fused" if self.fused else ""
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.optimizer}{fused}, {self.scaling}, {dtype}, {self.forward}"


CONFIGS = [
    Config(name, fused, scaling, dtype)
    for name in OPTIMIZERS
    for fused in (False, True)
    for scaling in ("none", "grad_scaler", "max_grad_norm")
    for dtype in (torch.float16, torch.bfloat16)
]
# The default step's configurations with the forward under mixedopt.autocast.
MIXEDOPT_AUTOCAST_CONFIGS = [
    dataclasses.replace(config, forward="mixedopt.autocast")
    for config in CONFIGS
    if not config.fused
]


def model(seed: int, widths: Sequence[int] = WIDTHS) -> nn.Sequential:
    """A tanh MLP of the given widths, its weights drawn from ``seed``'s own generator."""
    generator = torch.Generator().manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (fan_in, fan_out) in enumerate(itertools.pairwise(widths)):
        linear = nn.Linear(fan_in, fan_out)
        with torch.no_grad():
            linear.weight.copy_(torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5)
            linear.bias.copy_(torch.randn(fan_out, generator=generator) * 0.1)
        layers.append(linear)
        if i < len(widths) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


def optimizer(config: Config, params: Any) -> torch.optim.Optimizer:
    cls, kwargs = OPTIMIZERS[config.optimizer]
    extra: dict[str, Any] = {"grad_dtype": config.dtype}
    if config.fused:
        extra["fused"] = True
    if config.scaling == "max_grad_norm":
        extra["max_grad_norm"] = 0.5
    return cls(params, **kwargs, **extra)


class Training:
    """One model, its optimizer, GradScaler and inputs: a training run of ``config``."""

    def __init__(self, config: Config, seed: int, in_backward: bool = False) -> None:
        self.config = config
        self.in_backward = in_backward
        self.model = model(seed)
        self.opt = optimizer(config, self.model.parameters())
        self.scaler = None
        if config.scaling == "grad_scaler":
            self.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
            self.scaler.scale(torch.ones(()))  # its tables made here, not on the threads
        generator = torch.Generator().manual_seed(seed + 1000)
        self.inputs = [torch.randn(BATCH, WIDTHS[0], generator=generator) for _ in range(STEPS)]

    def loss(self, x: torch.Tensor, module: nn.Module | None = None) -> torch.Tensor:
        region = mixedopt.autocast if self.config.forward == "mixedopt.autocast" else torch.autocast
        with region("cpu", dtype=self.config.dtype):
            loss = (module or self.model)(x).float().square().mean()
        return loss if self.scaler is None else self.scaler.scale(loss)

    def step(self) -> None:
        if self.scaler is None:
            self.opt.step()
        else:
            self.scaler.step(self.opt)
            self.scaler.update()
        self.opt.zero_grad()

    def __call__(self) -> None:
        """Train: a step per input (each backward starts with the others', ``run_together``)."""
        for x in self.inputs:
            in_step()
            if self.in_backward:
                with self.opt.step_in_backward():
                    self.loss(x).backward()
            else:
                self.loss(x).backward()
                self.step()

    def result(self) -> list[torch.Tensor]:
        """Weights and every tensor of the optimizer's state, in order."""
        found = [p.detach().clone() for p in self.model.parameters()]
        for state in self.opt.state_dict()["state"].values():
            found += [v.clone() for _, v in sorted(state.items()) if torch.is_tensor(v)]
        return found


def assert_bitwise_equal(got: list[torch.Tensor], expected: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected, strict=True)):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: tensor {i}"
        same = torch.equal(a.view(-1).view(torch.int32), b.view(-1).view(torch.int32))
        assert same, f"{what}: tensor {i} differs by {(a - b).abs().max().item():.3g}"


_together = threading.local()


def in_step() -> None:
    """Wait for the other threads of ``run_together`` to get here too (then start together).

    A thread that finished its work no longer waits: the others go on without it.
    """
    barrier = getattr(_together, "barrier", None)
    if barrier is not None:
        barrier.wait()


def run_together(work: Sequence[Callable[[], None]]) -> None:
    """Run each of ``work`` on a thread of its own, all started at once; raise what one raised.

    Each step of a ``Training`` (``in_step``) starts with those of the other threads, so that
    their backwards run at once.
    """
    errors: list[BaseException] = []
    barrier = _Steps(len(work))

    def run(function: Callable[[], None]) -> None:
        _together.barrier = barrier
        try:
            barrier.wait()
            function()
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            errors.append(error)
            barrier.abort()
        finally:
            barrier.leave()

    threads = [threading.Thread(target=run, args=(function,)) for function in work]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
        assert not thread.is_alive(), "a thread did not finish"
    if errors:
        raise errors[0]


class _Steps:
    """A barrier for a number of threads that may leave it (``threading.Barrier`` cannot)."""

    def __init__(self, parties: int) -> None:
        self._condition = threading.Condition()
        self._parties = parties
        self._waiting = 0
        self._generation = 0
        self._aborted = False

    def _release(self) -> None:
        self._waiting = 0
        self._generation += 1
        self._condition.notify_all()

    def wait(self) -> None:
        with self._condition:
            if self._aborted:
                raise threading.BrokenBarrierError
            self._waiting += 1
            if self._waiting >= self._parties:
                self._release()
                return
            generation = self._generation
            while generation == self._generation and not self._aborted:
                self._condition.wait()
            if self._aborted:
                raise threading.BrokenBarrierError

    def leave(self) -> None:
        with self._condition:
            self._parties -= 1
            if self._parties and self._waiting >= self._parties:
                self._release()

    def abort(self) -> None:
        with self._condition:
            self._aborted = True
            self._condition.notify_all()


def run_alone(function: Callable[[], None]) -> None:
    """Run ``function`` on a thread of its own (torch's threading settings are per thread)."""
    run_together([function])


@contextlib.contextmanager
def interleaved() -> Iterator[list[warnings.WarningMessage]]:
    """Threads switched every 10 microseconds (not every 5 ms), and every warning recorded."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield caught
    finally:
        sys.setswitchinterval(interval)


def describe(caught: list[warnings.WarningMessage]) -> list[str]:
    return [f"{w.category.__name__}: {w.message}" for w in caught]

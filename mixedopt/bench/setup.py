"""What ``python -m mixedopt.bench`` compares, and setting one variant up.

The optimizers (``OPTIMIZERS``) and the variants of each (``VARIANTS``: torch.optim with
``foreach=True`` or ``fused=True``, mixedopt with its defaults or ``fused=True``), ``build``
that makes a variant's parameters, gradients and optimizer, ``teardown`` that frees them, and
``Row``, one optimizer x variant of the results. Also two helpers the other modules share:
``first_line`` of an error message, and ``positive``, the type of a count on a command line.
"""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

import mixedopt

# name on the command line -> (class name in torch.optim and mixedopt, constructor arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "rmsprop": ("RMSprop", {"lr": 1e-3}),
    "adam": ("Adam", {"lr": 1e-3}),
    "adamw": ("AdamW", {"lr": 1e-3}),
    "sgd": ("SGD", {"lr": 1e-3, "momentum": 0.9}),
    "adagrad": ("Adagrad", {"lr": 1e-3}),
    "adadelta": ("Adadelta", {}),
    "adamax": ("Adamax", {"lr": 1e-3}),
    "nadam": ("NAdam", {"lr": 1e-3}),
    "radam": ("RAdam", {"lr": 1e-3}),
    "asgd": ("ASGD", {"lr": 1e-3}),
    "rprop": ("Rprop", {"lr": 1e-3}),
    "adafactor": ("Adafactor", {"lr": 1e-3}),
    "muon": ("Muon", {"lr": 1e-3}),
}
# Optimizers measured on matrices (Muon takes nothing else; Adafactor factors their state):
# their parameters are rows of this many elements.
MATRIX_ROW = {"Muon": 1000, "Adafactor": 1000}
# Run without --optimizers: those with mixedopt's compiled kernels.
DEFAULT_OPTIMIZERS = ["rmsprop", "adam", "adamw", "sgd"]
VARIANTS: dict[str, str] = {
    "torch-foreach": "torch foreach",
    "torch-fused": "torch fused",
    "mixedopt": "mixedopt default",
    "mixedopt-fused": "mixedopt fused",
}
BASELINE = "torch-foreach"


class Unavailable(Exception):
    """A variant that cannot be built here; the message says why."""


@dataclass
class Row:
    """One optimizer x variant: what the table and the JSON file show."""

    optimizer: str
    variant: str
    available: bool = True
    reason: str | None = None
    first_step_ms: float | None = None
    # The first of the first and warm-up steps in which torch.compile compiled (1 = the first
    # step), and its time: mixedopt-fused only, and only where it compiles.
    compile_step: int | None = None
    first_step_compile_ms: float | None = None
    median_ms: float | None = None
    step_ms: list[float] = field(default_factory=list)
    warmup_ms: list[float] = field(default_factory=list)
    ratio_to_foreach: float | None = None
    persistent_bytes_per_param: float | None = None
    grad_dtype: str | None = None
    state_tensors_per_param: int | None = None
    min_bytes_per_param: int | None = None
    achieved_gbps: float | None = None
    stream_fraction: float | None = None
    peak_extra_bytes: int | None = None
    peak_extra_upper_bound: int | None = None  # set instead of peak_extra_bytes when inexact
    peak_extra_bytes_per_param: float | None = None
    peak_method: str | None = None
    peak_error: str | None = None
    warnings: list[str] = field(default_factory=list)  # first lines, raised by the steps


def first_line(error: BaseException | Warning | str) -> str:
    """The first line of ``error``'s message, or its type's name where it has none."""
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def positive(text: str) -> int:
    """A count of at least 1 on a command line (``2_000_000`` reads as 2000000)."""
    value = int(text.replace("_", ""))
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build(
    optimizer: str, variant: str, numel: int, count: int, device: torch.device, seed: int = 0
) -> tuple[list[nn.Parameter], torch.optim.Optimizer]:
    """Parameters with their gradients, and the optimizer of ``variant`` over them.

    Raises:
        Unavailable: the variant cannot be constructed here (the message says why).
    """
    class_name, kwargs = OPTIMIZERS[optimizer]
    generator = torch.Generator(device=device).manual_seed(seed)
    row = MATRIX_ROW.get(class_name)
    shape = (numel,) if row is None else (numel // row, row) if numel % row == 0 else (1, numel)
    params = [
        nn.Parameter(torch.randn(shape, generator=generator, device=device)) for _ in range(count)
    ]
    if variant == "torch-foreach":  # torch's only implementation where it has no foreach (Muon)
        cls = getattr(torch.optim, class_name)
        foreach = {"foreach": True} if "foreach" in inspect.signature(cls).parameters else {}
        opt = cls(params, **foreach, **kwargs)
    elif variant == "torch-fused":
        cls = getattr(torch.optim, class_name)
        if "fused" not in inspect.signature(cls.__init__).parameters:
            raise Unavailable(f"torch.optim.{class_name} has no fused implementation")
        try:
            opt = cls(params, fused=True, **kwargs)
        except Exception as error:  # whatever the reason, the row says it
            raise Unavailable(first_line(error)) from None
    elif variant == "mixedopt":
        opt = getattr(mixedopt, class_name)(params, **kwargs)
    elif variant == "mixedopt-fused":
        try:
            opt = getattr(mixedopt, class_name)(params, fused=True, **kwargs)
        except Exception as error:  # whatever the reason, the row says it
            raise Unavailable(first_line(error)) from None
    else:
        raise ValueError(f"unknown variant {variant!r}")
    # The optimizer exists first: a mixedopt one decides what backward() leaves in .grad. The
    # gradient of sum(p * c) is c; one parameter at a time, to keep the set-up peak small.
    for p in params:
        c = torch.randn(shape, generator=generator, device=device).mul_(1e-2)
        (p * c).sum().backward()
        del c
    return params, opt


def teardown(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> None:
    """Drop the gradients first, so that releasing mixedopt's storage converts nothing.

    The optimizer and its parameters sit in reference cycles: ``gc.collect()`` frees them.
    """
    for p in params:
        p.grad = None
    remove = getattr(opt, "remove_grad_storage", None)
    if remove is not None:
        remove()
    opt.state.clear()

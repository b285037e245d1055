"""Kernel launches and host synchronisations of the accelerator path, counted without one.

On a GPU every operation that runs a kernel costs a launch (microseconds of host time) and every
value read on the host waits for the device. Parameters on PyTorch's ``meta`` device take every
branch mixedopt takes on an accelerator and do no work, so a ``TorchDispatchMode`` counts, on
any machine and deterministically, what a GPU would pay (``LaunchCounter``):

* launches: the aten operations dispatched on non-CPU tensors, except views and what launches
  no kernel (allocations, ``detach``, ``lift_fresh``, ``set_``, the profiler's record-function
  markers);
* host synchronisations: ``_local_scalar_dense`` (``.item()``, ``bool()``) on a non-CPU tensor.
  A meta tensor holds no value: the counter answers ``False``/``0`` (no inf or NaN found).

``launch_counts`` counts one ``backward()`` and one ``step()`` of torch.optim with
``foreach=True`` (what torch picks on CUDA) and of mixedopt with ``foreach=True``, for a model
of ``Linear`` layers at two depths; ``launch_table`` gives, for the models and optimizers below,
what mixedopt launches beyond torch.optim per parameter (the difference between the depths over
the parameters added) and the constant left at the deeper one, backward and step together.

``python -m mixedopt.bench.launches`` prints the table (a few seconds);
``python -m mixedopt.bench`` prints it too.
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import mixedopt

# Operations that run no kernel: allocations, and what only makes a new tensor object or
# points one at a storage (``set_``, fused=True's flat alias of a parameter).
NO_LAUNCH = frozenset(
    {
        "empty",
        "empty_like",
        "empty_strided",
        "new_empty",
        "new_empty_strided",
        "detach",
        "lift_fresh",
        "set_",
        "_record_function_enter_new",
        "_record_function_exit",
    }
)


class LaunchCounter(TorchDispatchMode):
    """Counts the kernel launches and host synchronisations of the code run under it.

    Args:
        cpu: count the operations on CPU tensors as launches too, for code that cannot run on
            the meta device (autocast); host synchronisations stay those of non-CPU tensors.
    """

    def __init__(self, cpu: bool = False) -> None:
        super().__init__()
        self.cpu = cpu
        self.launches = 0
        self.syncs = 0
        self.by_name: Counter[str] = Counter()  # launches per operation

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            (tensor,) = args
            if tensor.device.type != "cpu":
                self.syncs += 1
                return False if tensor.dtype == torch.bool else 0
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if self.launches_kernel(func, args, kwargs, out):
            self.launches += 1
            self.by_name[func.overloadpacket.__name__] += 1
            self.launched(func, args, kwargs, out)
        return out

    def launches_kernel(self, func: Any, args: Any, kwargs: Any, out: Any) -> bool:
        """Whether the aten operation ``func`` run on ``args`` and ``kwargs`` launched a kernel."""
        if func.is_view or func.overloadpacket.__name__ in NO_LAUNCH:
            return False
        tensors = [t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)]
        return any(self.cpu or t.device.type != "cpu" for t in tensors)

    def launched(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Called after each launch counted, for a subclass to count more of it."""


@dataclass(frozen=True)
class Counts:
    """What one ``backward()`` and one ``step()`` launched, and the host synchronisations."""

    params: int
    backward: int
    step: int
    syncs: int


# name -> (torch.optim class, mixedopt class, constructor arguments)
OPTIMIZERS: dict[str, tuple[type, type, dict[str, Any]]] = {
    "AdamW": (torch.optim.AdamW, mixedopt.AdamW, {}),
    "SGD momentum": (torch.optim.SGD, mixedopt.SGD, {"lr": 0.1, "momentum": 0.9}),
    "RMSprop": (torch.optim.RMSprop, mixedopt.RMSprop, {}),
}
# name -> (width, bias) of the Linear layers
MODELS: dict[str, tuple[int, bool]] = {
    "Linear(64, 64)": (64, True),
    "Linear(2048, 2048)": (2048, False),
    "Linear(4096, 4096)": (4096, False),
}
LAYERS = (4, 16)


def launch_counts(
    make: Callable[[Any], torch.optim.Optimizer], layers: int, width: int, bias: bool
) -> Counts:
    """Launches of one ``backward()`` and one ``step()`` of ``layers x Linear(width, width)``.

    On the meta device, after two iterations that create the state (and warm every cache).
    """
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(width, width, bias=bias) for _ in range(layers)])
        x = torch.empty(16, width)
    params = list(model.parameters())
    optimizer = make(params)
    with LaunchCounter():  # meta values cannot be read: the warm-up runs counted too
        for _ in range(2):
            model(x).square().mean().backward()
            optimizer.step()
            optimizer.zero_grad()
    loss = model(x).square().mean()
    with LaunchCounter() as backward:
        loss.backward()
    with LaunchCounter() as step:
        optimizer.step()
    optimizer.zero_grad()
    if isinstance(optimizer, mixedopt.MixedPrecisionOptimizer):
        optimizer.remove_grad_storage()
    return Counts(len(params), backward.launches, step.launches, backward.syncs + step.syncs)


@dataclass(frozen=True)
class Row:
    """mixedopt against torch.optim (foreach) for one model and optimizer."""

    model: str
    optimizer: str
    torch: Counts  # at the deeper model
    mixedopt: Counts
    backward_per_param: float  # launches beyond torch's per parameter added
    step_per_param: float
    constant: float  # beyond torch's at the deeper model, less the per-parameter ones


def compare(model: str, optimizer: str, layers: Sequence[int] = LAYERS) -> Row:
    """Count torch.optim and mixedopt at two depths of ``model``."""
    width, bias = MODELS[model]
    torch_class, mixed_class, kwargs = OPTIMIZERS[optimizer]
    shallow, deep = layers

    def extra(depth: int) -> tuple[Counts, Counts, int, int]:
        theirs = launch_counts(lambda p: torch_class(p, foreach=True, **kwargs), depth, width, bias)
        ours = launch_counts(lambda p: mixed_class(p, foreach=True, **kwargs), depth, width, bias)
        return theirs, ours, ours.backward - theirs.backward, ours.step - theirs.step

    _, _, backward_shallow, step_shallow = extra(shallow)
    theirs, ours, backward_deep, step_deep = extra(deep)
    added = ours.params * (deep - shallow) // deep
    backward_per_param = (backward_deep - backward_shallow) / added
    step_per_param = (step_deep - step_shallow) / added
    constant = backward_deep + step_deep - (backward_per_param + step_per_param) * ours.params
    return Row(model, optimizer, theirs, ours, backward_per_param, step_per_param, constant)


def launch_table() -> list[Row]:
    """``compare`` of every model of ``MODELS`` with every optimizer of ``OPTIMIZERS``."""
    return [compare(model, optimizer) for model in MODELS for optimizer in OPTIMIZERS]


def format_launch_table(rows: Sequence[Row]) -> str:
    """The table ``python -m mixedopt.bench.launches`` prints."""
    deep = LAYERS[1]
    header = (
        "model",
        "optimizer",
        "backward/param",
        "step/param",
        "constant",
        f"torch {deep} layers",
        f"mixedopt {deep} layers",
        "host syncs/step",
    )
    lines = [header]
    for row in rows:
        lines.append(
            (
                row.model,
                row.optimizer,
                f"{row.backward_per_param:+g}",
                f"{row.step_per_param:+g}",
                f"{row.constant:+g}",
                f"{row.torch.backward} + {row.torch.step}",
                f"{row.mixedopt.backward} + {row.mixedopt.step}",
                f"{row.torch.syncs} vs {row.mixedopt.syncs}",
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    text = [
        "Kernel launches of the accelerator path (parameters on the meta device), mixedopt beyond "
        "torch.optim(foreach=True):",
        f"per parameter between {LAYERS[0]} and {deep} layers, the constant at {deep} layers "
        "(backward and step together), and the totals (backward + step).",
    ]
    for i, line in enumerate(lines):
        cells = [
            cell.ljust(width) if j < 2 else cell.rjust(width)
            for j, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        text.append("  ".join(cells))
        if i == 0:
            text.append("  ".join("-" * width for width in widths))
    return "\n".join(text)


def main(argv: Sequence[str] | None = None) -> int:
    """Print the launch table."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench.launches",
        description="Count the kernel launches and host synchronisations of the accelerator "
        "path (meta parameters) of mixedopt and torch.optim(foreach=True).",
    )
    parser.parse_args(argv)
    print(format_launch_table(launch_table()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

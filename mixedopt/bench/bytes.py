"""Bytes moved per parameter by an iteration, beside its kernel launches, counted without a GPU.

On a GPU a large parameter costs, besides its launches (``mixedopt.bench.launches``), every byte
its kernels read and write: an H200 moves about 4 TB/s. ``ByteCounter`` is the launch counter of
``mixedopt.bench.launches`` (the same operations count as launches, the same host
synchronisations) that also adds up, for each launch, the bytes it reads and writes and the
floating-point operations of its matrix products (``torch.utils.flop_counter``'s formulas).

The rule for bytes, per operation that launches a kernel:

* read: every tensor argument, each as often as it is passed (``addcmul_(a, g, g)`` reads ``g``
  twice, as a kernel that loads each operand does), except ``out=`` arguments;
* written: every tensor the operation returns, and every argument its schema marks as written
  (``Tensor(a!)``: the ``self`` of an in-place operation, ``out=``, the lists of an in-place
  ``_foreach_`` operation, which return nothing), each once;
* so an in-place operation reads and writes its ``self``, except those that overwrite it
  without reading it (``OVERWRITE``: ``copy_``, ``fill_``, ``zero_`` and their ``_foreach_``
  forms), and an ``out=`` argument is written, not read;
* a tensor's bytes are those of the elements it addresses: its element size times the product
  of its sizes along the dimensions of non-zero stride (a scalar expanded is one element).

Two paths, each library with AdamW (torch.optim's ``foreach=True``, what torch picks on CUDA;
mixedopt's default step):

* the accelerator path (``ACCELERATOR``): parameters on the ``meta`` device, which take every
  branch mixedopt takes on an accelerator and do no work, float32 forward;
* the autocast path (``AUTOCAST``): the meta device has no autocast, so CPU tensors, the forward
  under ``torch.autocast("cpu", float16)``, and mixedopt's also under ``mixedopt.autocast``.
  Launches there count every operation, the CPU's own included; mixedopt takes its CPU branches.

``format_roofline`` turns the counts of an iteration into a time on a model of an NVIDIA H200
(``H200``): launches x 4 us + bytes / 4 TB/s + flops / 700 TFLOP/s, an estimate, not a
measurement (``ROOFLINE_REGIMES``: 16 x ``Linear(4096)``, 512 tokens; 32 x ``Linear(1024)``,
2048 tokens).

``python -m mixedopt.bench.bytes`` prints both (a few seconds); ``--ops`` adds, for each part of
an iteration, the bytes per parameter of each operation.
"""

from __future__ import annotations

import argparse
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import flop_registry

import mixedopt

from .launches import LaunchCounter

# In-place operations that overwrite their ``self`` without reading it.
OVERWRITE = frozenset({"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"})


def addressed_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the elements ``tensor`` addresses: a dimension of stride 0 counts once."""
    elements = 1
    for size, stride in zip(tensor.shape, tensor.stride(), strict=True):
        if stride != 0:
            elements *= size
    return 0 if tensor.numel() == 0 else elements * tensor.element_size()


class ByteCounter(LaunchCounter):
    """Counts launches and host synchronisations, and the bytes and flops of each launch.

    Args:
        cpu: count operations on CPU tensors too (see ``LaunchCounter``).
    """

    def __init__(self, cpu: bool = False) -> None:
        super().__init__(cpu)
        self.read = 0
        self.written = 0
        self.flops = 0
        self.bytes_by_name: Counter[str] = Counter()  # bytes read and written per operation
        self.read_by_dtype: Counter[torch.dtype] = Counter()  # bytes read per element type

    def launched(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        """Add the bytes ``func`` read and wrote, and its flops."""
        name = func.overloadpacket.__name__
        read: list[torch.Tensor] = []
        written: dict[int, torch.Tensor] = {}
        schema = func._schema.arguments
        positional = [a for a in schema if not a.kwarg_only]
        named = [(a, v) for a, v in zip(positional, args, strict=False)]
        named += [(a, kwargs[a.name]) for a in schema if a.name in kwargs]
        for argument, value in named:
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            writes = argument.alias_info is not None and argument.alias_info.is_write
            if writes:
                written.update((id(t), t) for t in tensors)
            if not (argument.is_out or (writes and name in OVERWRITE)):
                read += tensors
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                written.setdefault(id(tensor), tensor)
        for tensor in read:
            self.read_by_dtype[tensor.dtype] += addressed_bytes(tensor)
        read_bytes = sum(addressed_bytes(t) for t in read)
        written_bytes = sum(addressed_bytes(t) for t in written.values())
        self.read += read_bytes
        self.written += written_bytes
        self.bytes_by_name[name] += read_bytes + written_bytes
        if func.overloadpacket in flop_registry:
            self.flops += flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)

    @property
    def bytes(self) -> int:
        """Bytes read and written."""
        return self.read + self.written


@dataclass(frozen=True)
class Part:
    """What one part of an iteration (forward, backward, ``step()``) launched and moved."""

    launches: int
    syncs: int
    read: int
    written: int
    flops: int
    bytes_by_name: dict[str, int]

    @property
    def bytes(self) -> int:
        """Bytes read and written."""
        return self.read + self.written

    @classmethod
    def of(cls, counter: ByteCounter) -> Part:
        """The counts ``counter`` holds."""
        return cls(
            counter.launches,
            counter.syncs,
            counter.read,
            counter.written,
            counter.flops,
            dict(counter.bytes_by_name),
        )

    def __add__(self, other: Part) -> Part:
        return Part(
            self.launches + other.launches,
            self.syncs + other.syncs,
            self.read + other.read,
            self.written + other.written,
            self.flops + other.flops,
            dict(Counter(self.bytes_by_name) + Counter(other.bytes_by_name)),
        )


@dataclass(frozen=True)
class Iteration:
    """One forward, backward and ``step()`` of a model, counted."""

    params: int  # elements of the parameters
    forward: Part
    backward: Part
    step: Part

    @property
    def forward_backward(self) -> Part:
        """Forward and backward together."""
        return self.forward + self.backward

    @property
    def total(self) -> Part:
        """The whole iteration."""
        return self.forward + self.backward + self.step

    def per_param(self, part: Part) -> float:
        """``part``'s bytes per parameter."""
        return part.bytes / self.params


@dataclass(frozen=True)
class Regime:
    """A model of ``layers x Linear(width, width)``, ``tokens`` rows of input, on a path."""

    layers: int
    width: int
    tokens: int
    device: str  # "meta": the accelerator path; "cpu": the autocast path
    bias: bool = False

    @property
    def label(self) -> str:
        """``16 x Linear(4096), 512 tokens``."""
        return f"{self.layers} x Linear({self.width}), {self.tokens} tokens"


ACCELERATOR = Regime(16, 4096, 512, "meta")
AUTOCAST = Regime(8, 512, 64, "cpu")
# Models of the roofline estimate, on the accelerator path.
ROOFLINE_REGIMES = (ACCELERATOR, Regime(32, 1024, 2048, "meta"))


def torch_adamw(params: Any) -> torch.optim.Optimizer:
    """torch.optim.AdamW with ``foreach=True``, what torch picks on CUDA."""
    return torch.optim.AdamW(params, foreach=True)


def mixedopt_adamw(params: Any) -> torch.optim.Optimizer:
    """mixedopt.AdamW's default step (``foreach=True``)."""
    return mixedopt.AdamW(params, foreach=True)


def forward_context(regime: Regime, autocast: str | None) -> contextlib.AbstractContextManager[Any]:
    """The context the forward runs in: none, ``torch.autocast`` or ``mixedopt.autocast``."""
    if autocast is None:
        return contextlib.nullcontext()
    if autocast == "torch":
        return torch.autocast(regime.device, dtype=torch.float16)
    return mixedopt.autocast(regime.device, dtype=torch.float16)


@contextlib.contextmanager
def _seeded() -> Iterator[None]:
    state = torch.random.get_rng_state()
    torch.manual_seed(0)
    try:
        yield
    finally:
        torch.random.set_rng_state(state)


def count_iteration(
    make: Callable[[Any], torch.optim.Optimizer], regime: Regime, autocast: str | None = None
) -> Iteration:
    """Launches, bytes and flops of a forward, a backward and a ``step()`` of ``regime``.

    After two iterations that create the optimizer's state (and warm every cache). The loss is
    the mean square of the output, in float32.
    """
    cpu = regime.device == "cpu"
    with _seeded(), torch.device(regime.device):
        model = nn.Sequential(
            *[nn.Linear(regime.width, regime.width, bias=regime.bias) for _ in range(regime.layers)]
        )
        x = torch.randn(regime.tokens, regime.width)
    params = list(model.parameters())
    optimizer = make(params)

    def forward() -> torch.Tensor:
        with forward_context(regime, autocast):
            return model(x).float().square().mean()

    with LaunchCounter(cpu):  # meta values cannot be read: the warm-up runs counted too
        for _ in range(2):
            forward().backward()
            optimizer.step()
            optimizer.zero_grad()
    with ByteCounter(cpu) as forward_counter:
        loss = forward()
    with ByteCounter(cpu) as backward_counter:
        loss.backward()
    with ByteCounter(cpu) as step_counter:
        optimizer.step()
    optimizer.zero_grad()
    if isinstance(optimizer, mixedopt.MixedPrecisionOptimizer):
        optimizer.remove_grad_storage()
    return Iteration(
        sum(p.numel() for p in params),
        Part.of(forward_counter),
        Part.of(backward_counter),
        Part.of(step_counter),
    )


@dataclass(frozen=True)
class Case:
    """One row of the table: a library on a path, the forward in a context."""

    path: str  # "accelerator" or "autocast"
    regime: Regime
    autocast: str | None  # the forward's: None (float32), "torch" or "mixedopt"
    library: str  # "torch.optim" or "mixedopt"

    @property
    def forward(self) -> str:
        """How the forward computes: ``float32``, ``torch.autocast`` or ``mixedopt.autocast``."""
        return "float32" if self.autocast is None else f"{self.autocast}.autocast"

    def count(self) -> Iteration:
        """The counts of an iteration of this case."""
        make = torch_adamw if self.library == "torch.optim" else mixedopt_adamw
        return count_iteration(make, self.regime, self.autocast)


# The rows of the table. mixedopt's are compared with the torch.optim row of their path.
CASES = (
    Case("accelerator", ACCELERATOR, None, "torch.optim"),
    Case("accelerator", ACCELERATOR, None, "mixedopt"),
    Case("autocast", AUTOCAST, "torch", "torch.optim"),
    Case("autocast", AUTOCAST, "torch", "mixedopt"),
    Case("autocast", AUTOCAST, "mixedopt", "mixedopt"),
)


def bytes_table(cases: Sequence[Case] = CASES) -> list[tuple[Case, Iteration]]:
    """Each case with its counts."""
    return [(case, case.count()) for case in cases]


def _reference(rows: Sequence[tuple[Case, Iteration]], case: Case) -> Iteration:
    return next(c for other, c in rows if other.path == case.path and other.library != "mixedopt")


def _aligned(lines: Sequence[Sequence[str]], left: int) -> list[str]:
    """``lines`` in columns, the first ``left`` to the left, a rule under the header."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = []
    for i, line in enumerate(lines):
        cells = [
            cell.ljust(width) if j < left else cell.rjust(width)
            for j, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        text.append("  ".join(cells).rstrip())
        if i == 0:
            text.append("  ".join("-" * width for width in widths))
    return text


def format_bytes_table(rows: Sequence[tuple[Case, Iteration]]) -> str:
    """The table of bytes per parameter and launches ``python -m mixedopt.bench.bytes`` prints."""
    lines: list[tuple[str, ...]] = [
        (
            "path",
            "forward",
            "optimizer",
            "launches fwd + bwd + step",
            "B/param fwd + bwd + step",
            "fwd+bwd",
            "beyond torch",
            "step",
            "beyond torch",
            "host syncs",
        )
    ]
    models = {}
    for case, c in rows:
        models[case.path] = case.regime
        reference = _reference(rows, case)
        beyond = case.library == "mixedopt"
        fwd_bwd, step = c.per_param(c.forward_backward), c.per_param(c.step)
        lines.append(
            (
                case.path,
                case.forward,
                case.library,
                f"{c.forward.launches} + {c.backward.launches} + {c.step.launches}",
                f"{c.per_param(c.forward):.2f} + {c.per_param(c.backward):.2f} + {step:.2f}",
                f"{fwd_bwd:.2f}",
                f"{fwd_bwd - reference.per_param(reference.forward_backward):+.2f}"
                if beyond
                else "",
                f"{step:.2f}",
                f"{step - reference.per_param(reference.step):+.2f}" if beyond else "",
                "-" if case.regime.device == "cpu" else str(c.total.syncs),
            )
        )
    return "\n".join(
        [
            "Bytes per parameter and kernel launches of one AdamW iteration (forward, backward, "
            "step()), counted: the same on any machine.",
            "torch.optim(foreach=True) and mixedopt's default step (foreach=True); 'beyond "
            "torch': mixedopt's bytes per parameter less torch.optim's on its path.",
            *(
                f"{path}: {regime.label}, "
                + (
                    "parameters on the meta device (a GPU's branches, no work)."
                    if regime.device == "meta"
                    else "CPU tensors under autocast(float16) (meta has none), mixedopt's CPU "
                    "branches, every operation a launch."
                )
                for path, regime in models.items()
            ),
            "Bytes: what each operation that launches a kernel reads and writes (the rule: "
            "mixedopt.bench.bytes's docstring).",
            *_aligned(lines, 3),
        ]
    )


def format_ops(counted: Sequence[tuple[str, Iteration]], least: float = 0.005) -> str:
    """Bytes per parameter of each operation of each labelled iteration, at least ``least``."""
    text = [f"Bytes per parameter by operation (at least {least}):"]
    for label, c in counted:
        for name in ("forward", "backward", "step"):
            part: Part = getattr(c, name)
            ops = sorted(part.bytes_by_name.items(), key=lambda item: -item[1])
            listed = ", ".join(f"{op} {b / c.params:.3f}" for op, b in ops if b / c.params >= least)
            text.append(f"  {label}, {name}: {listed}")
    return "\n".join(text)


@dataclass(frozen=True)
class Roofline:
    """A device as three rates: the time of a launch, of a byte, of a floating-point operation."""

    name: str
    launch_s: float  # seconds per kernel launch
    bytes_per_s: float
    flops_per_s: float

    def seconds(self, part: Part) -> tuple[float, float, float]:
        """The time of ``part``'s launches, of its bytes and of its flops, each alone."""
        return (
            part.launches * self.launch_s,
            part.bytes / self.bytes_per_s,
            part.flops / self.flops_per_s,
        )


H200 = Roofline("NVIDIA H200", 4e-6, 4e12, 700e12)


def roofline_table(
    regimes: Sequence[Regime] = ROOFLINE_REGIMES,
) -> list[tuple[Regime, Iteration, Iteration]]:
    """torch.optim's and mixedopt's counts of an iteration of each of ``regimes``."""
    return [
        (regime, count_iteration(torch_adamw, regime), count_iteration(mixedopt_adamw, regime))
        for regime in regimes
    ]


def format_roofline(rows: Sequence[tuple[Regime, Iteration, Iteration]], device: Roofline) -> str:
    """The roofline estimate ``python -m mixedopt.bench.bytes`` prints."""
    lines: list[tuple[str, ...]] = [
        (
            "model",
            "optimizer",
            "launches",
            "B/param fwd+bwd + step",
            "GB",
            "GFLOP",
            "launches ms",
            "bytes ms",
            "flops ms",
            "estimate ms",
            "ratio",
        )
    ]
    for regime, theirs, ours in rows:
        times = []
        for library, c in (("torch.optim", theirs), ("mixedopt", ours)):
            part = c.total
            parts = device.seconds(part)
            times.append(sum(parts))
            lines.append(
                (
                    regime.label,
                    library,
                    str(part.launches),
                    f"{c.per_param(c.forward_backward):.2f} + {c.per_param(c.step):.2f}",
                    f"{part.bytes / 1e9:.2f}",
                    f"{part.flops / 1e9:.0f}",
                    *(f"{t * 1e3:.3f}" for t in parts),
                    f"{sum(parts) * 1e3:.3f}",
                    f"{times[-1] / times[0]:.2f}x",
                )
            )
    return "\n".join(
        [
            f"ESTIMATE, not a measurement: one AdamW iteration (forward, backward, step()) on a "
            f"roofline model of an {device.name},",
            f"time = launches x {device.launch_s * 1e6:g} us + bytes / "
            f"{device.bytes_per_s / 1e12:g} TB/s + flops / {device.flops_per_s / 1e12:g} TFLOP/s "
            "(the three added, none overlapped),",
            "from the counts of the accelerator path (flops: the matrix products'); ratio: "
            "mixedopt's over torch.optim(foreach=True)'s.",
            *_aligned(lines, 2),
        ]
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Print the bytes table and the roofline estimate."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt.bench.bytes",
        description="Count the bytes per parameter and the kernel launches of an AdamW "
        "iteration of mixedopt and torch.optim(foreach=True), on the accelerator path (meta "
        "parameters) and the autocast path (CPU tensors), and estimate an H200 iteration.",
    )
    parser.add_argument(
        "--ops",
        action="store_true",
        help="also print the bytes per parameter of each operation, per part of the iteration",
    )
    args = parser.parse_args(argv)
    rows = bytes_table()
    print(format_bytes_table(rows))
    print()
    estimated = roofline_table()
    print(format_roofline(estimated, H200))
    if args.ops:
        print()
        labelled = [(f"{case.path}, {case.forward}, {case.library}", c) for case, c in rows]
        for regime, theirs, ours in estimated[1:]:  # the first is the accelerator path's
            labelled += [
                (f"{regime.label}, torch.optim", theirs),
                (f"{regime.label}, mixedopt", ours),
            ]
        print(format_ops(labelled))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

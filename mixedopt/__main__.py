"""``python -m mixedopt``: torch.optim.RMSprop and mixedopt.RMSprop side by side.

A small Conv2d(3, 64, 3) network is trained under ``torch.autocast(float16)`` twice, from the same
initial weights on the same data, with a CosineAnnealingLR schedule: once with
``torch.optim.RMSprop`` and once with ``mixedopt.RMSprop``. The table shows what each keeps in
memory, how long a step takes, the loss at every step and how far the weights end up apart.

The step time is measured apart from the training steps, in the steady state: once the training
is over and the weights are compared, each optimizer's ``step()`` is run again on the last
batch's gradients, ``WARMUP_STEPS`` times untimed and then ``--timed-steps`` times timed, the two
optimizers taking turns; the table shows the median of the timed steps. The training steps
themselves are too few, and include the first step (which creates the optimizer state) and the
warm-up of the machine's caches and threads.
"""

from __future__ import annotations

import argparse
import copy
import math
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, TypedDict

import torch
from torch import nn

import mixedopt


def build_model(channels: int, classes: int) -> nn.Module:
    """The demo network: two 3x3 convolutions, pooling and a linear classifier."""
    return nn.Sequential(
        nn.Conv2d(3, channels, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(channels, channels, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(channels, classes),
    )


class TrainResult(TypedDict):
    """What :func:`train` found: one column of the demo's table."""

    losses: list[float]  # per step
    grad_dtype: torch.dtype | None  # of the last step's gradients
    grad_bytes: int  # held by the last step's gradients
    state_dtype: str  # of the optimizer state's tensors, "step" left out
    weight_dtype: torch.dtype


def train(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    device: torch.device,
) -> TrainResult:
    """Run one step per batch; return the losses and what the gradients and the state held."""
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=len(batches))
    losses: list[float] = []
    grad_bytes: int = 0
    grad_dtype: torch.dtype | None = None
    for images, labels in batches:
        optimizer.zero_grad()
        with torch.autocast(device.type, dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        grad_bytes = sum(g.nbytes for g in grads)
        grad_dtype = grads[0].dtype
        optimizer.step()
        scheduler.step()
        losses.append(loss.item())
    state_dtypes = {
        value.dtype
        for state in optimizer.state.values()
        for key, value in state.items()
        if torch.is_tensor(value) and key != "step"
    }
    return {
        "losses": losses,
        "grad_dtype": grad_dtype,
        "grad_bytes": grad_bytes,
        "state_dtype": ", ".join(sorted(str(d) for d in state_dtypes)),
        "weight_dtype": next(model.parameters()).dtype,
    }


# Untimed steps of each optimizer before the timed ones (caches, allocator, worker threads).
WARMUP_STEPS = 20


def time_steps(
    optimizers: Sequence[torch.optim.Optimizer], timed: int, device: torch.device
) -> list[float]:
    """Median milliseconds of one ``step()`` of each optimizer, in the steady state.

    Each optimizer steps on the gradients its parameters hold (they are kept across steps, as
    nothing zeroes them), first ``WARMUP_STEPS`` times untimed, then ``timed`` times timed. The
    optimizers take turns, one step each per round, each round starting with the next one, so
    that the machine speeding up or slowing down while they run reaches all of them alike.
    The steps change the weights and the optimizer state: time them after any comparison.
    """
    for _ in range(WARMUP_STEPS):
        for optimizer in optimizers:
            optimizer.step()
    times: list[list[float]] = [[] for _ in optimizers]
    order = list(range(len(optimizers)))
    for round_index in range(timed):
        shift = round_index % len(order)
        for i in order[shift:] + order[:shift]:
            _synchronize(device)
            start = time.perf_counter()
            optimizers[i].step()
            _synchronize(device)
            times[i].append(time.perf_counter() - start)
    return [1e3 * statistics.median(each) for each in times]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


DEVICES = ("cpu", "cuda")


def _checked(
    convert: Callable[[str], Any], noun: str, accept: Callable[[Any], bool], rule: str
) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert`` the text, then refuse what ``accept`` does not."""

    def parse(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {noun}: {text!r}") from None
        if not accept(value):
            raise argparse.ArgumentTypeError(f"must be {rule}, got {text}")
        return value

    return parse


_at_least_one = _checked(int, "a whole number", lambda v: v >= 1, "at least 1")
_positive_float = _checked(
    float, "a number", lambda v: math.isfinite(v) and v > 0, "a finite number above 0"
)
# What torch.manual_seed takes.
_seed = _checked(int, "a whole number", lambda v: 0 <= v < 2**64, "from 0 to 2**64 - 1")


def _plural(count: int, word: str) -> str:
    return f"{count} {word}" if count == 1 else f"{count} {word}s"


def make_parser() -> argparse.ArgumentParser:
    """The command line's parser: every option has a help text and checks its value."""
    parser = argparse.ArgumentParser(
        prog="python -m mixedopt",
        description="Train a small Conv2d network under autocast(float16) with "
        "torch.optim.RMSprop and with mixedopt.RMSprop, side by side.",
    )
    parser.add_argument(
        "--steps", type=_at_least_one, default=10, help="optimizer steps, 1 or more (default 10)"
    )
    parser.add_argument(
        "--timed-steps",
        type=_at_least_one,
        default=200,
        help="steps of each optimizer timed after the training steps and "
        f"{WARMUP_STEPS} warm-up steps, for the median step time; 1 or more (default 200)",
    )
    parser.add_argument(
        "--batch-size", type=_at_least_one, default=32, help="images per batch (default 32)"
    )
    parser.add_argument(
        "--image-size", type=_at_least_one, default=16, help="image side in pixels (default 16)"
    )
    parser.add_argument(
        "--channels", type=_at_least_one, default=64, help="conv channels (default 64)"
    )
    parser.add_argument(
        "--lr", type=_positive_float, default=1e-3, help="learning rate, above 0 (default 1e-3)"
    )
    parser.add_argument(
        "--device",
        choices=DEVICES,
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="where to train: cpu or cuda (default: cuda when available)",
    )
    parser.add_argument(
        "--seed",
        type=_seed,
        default=0,
        help="random seed of the initial weights and the data (default 0)",
    )
    return parser


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    """Read the command line; a bad value is an argparse error (exit status 2)."""
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error(
            f"argument --device: cuda was asked for, but CUDA is not available here "
            f"(torch {torch.__version__}); use --device cpu"
        )
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo and print the side-by-side table."""
    args = parse_args(argv)
    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    classes = 10
    stock_model = build_model(args.channels, classes).to(device)
    mixed_model = copy.deepcopy(stock_model)
    batches = [
        (
            torch.randn(args.batch_size, 3, args.image_size, args.image_size, device=device),
            torch.randint(0, classes, (args.batch_size,), device=device),
        )
        for _ in range(args.steps)
    ]
    stock_optimizer = torch.optim.RMSprop(stock_model.parameters(), lr=args.lr)
    mixed_optimizer = mixedopt.RMSprop(mixed_model.parameters(), lr=args.lr)
    stock = train(stock_model, stock_optimizer, batches, device)
    mixed = train(mixed_model, mixed_optimizer, batches, device)
    difference = max(
        (a - b).abs().max().item()
        for a, b in zip(stock_model.parameters(), mixed_model.parameters(), strict=True)
    )
    parameters = sum(p.numel() for p in stock_model.parameters())
    # The timed steps come last: they change the weights compared above and the state whose
    # dtype the table shows. They run at the learning rate the schedule ended with (0 for
    # CosineAnnealingLR), which changes no step's work, only what it adds to the weights.
    stock_ms, mixed_ms = time_steps([stock_optimizer, mixed_optimizer], args.timed_steps, device)

    rows = [
        ("parameters", f"{parameters:,}", f"{parameters:,}"),
        ("weight dtype", str(stock["weight_dtype"]), str(mixed["weight_dtype"])),
        ("gradient dtype", str(stock["grad_dtype"]), str(mixed["grad_dtype"])),
        ("bytes held by gradients", f"{stock['grad_bytes']:,}", f"{mixed['grad_bytes']:,}"),
        ("optimizer state dtype", stock["state_dtype"], mixed["state_dtype"]),
        ("median step time (ms)", f"{stock_ms:.3f}", f"{mixed_ms:.3f}"),
    ]
    for i, (a, b) in enumerate(zip(stock["losses"], mixed["losses"], strict=True)):
        rows.append((f"loss at step {i + 1}", f"{a:.6f}", f"{b:.6f}"))

    print(
        f"Conv2d(3, {args.channels}, 3) network, autocast(float16), RMSprop(lr={args.lr}) + "
        f"CosineAnnealingLR, {_plural(args.steps, 'step')}, batch {args.batch_size} x 3 x "
        f"{args.image_size} x {args.image_size}, on {device}"
    )
    header = ("", "torch.optim.RMSprop", "mixedopt.RMSprop")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(3)]
    for row in [header, *rows]:
        print(f"{row[0]:<{widths[0]}}  {row[1]:>{widths[1]}}  {row[2]:>{widths[2]}}")
    print(f"largest weight difference after {_plural(args.steps, 'step')}: {difference:.3e}")
    print(
        f"step time: median of {_plural(args.timed_steps, 'timed step')} of each optimizer after "
        f"the training and {_plural(WARMUP_STEPS, 'warm-up step')} (step() alone, on the last "
        f"batch's gradients, the two optimizers taking turns)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

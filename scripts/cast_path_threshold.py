"""Whether the weights a GPU keeps in buckets should hand over their casts' gradients too.

Under ``mixedopt.autocast`` a weight stored alone gets the 16-bit gradient its cast's node
receives as its ``.grad``, unread (docs/design.md, "``mixedopt.autocast``"). A weight of at most
``budget(device).bucket_small`` elements (32Ki on a CPU, 1Mi on a GPU) waits in a bucket
instead, whose store reads float32 gradients, so its cast hands over nothing: counted with a
GPU's limits, 8 x ``Linear(512)`` moves 43.78 bytes per parameter in forward and backward under
``mixedopt.autocast``, where torch.optim moves 20.16 (docs/benchmarks.md). Handing over every
cast would take those gradients out of the buckets (no store in backward) and into the
reference path of ``step()`` (Python per parameter there). Three variants take turns iteration
by iteration on the same model and input, a chain of transformer-sized blocks (LayerNorm, four
``Linear(width, width)``, LayerNorm, ``Linear(width, 4 width)``, GELU, ``Linear(4 width,
width)``), AdamW, the loss the mean square of the output:

* ``torch``: ``torch.optim.AdamW(foreach=True)``, the forward under ``torch.autocast``;
* ``mixedopt``: ``mixedopt.AdamW``, the forward under ``mixedopt.autocast``;
* ``mixedopt, every cast``: the same, every weight's cast handing over its gradient (the
  storage's ``cast_hook`` asked with no bucket: its size limits set to 0 while it decides).

It prints the median forward and backward, step and iteration of each, in milliseconds and as a
ratio to torch's, and how many weights got their gradient from their cast's node.

    python scripts/cast_path_threshold.py [--device cuda] [--blocks 12] [--width 768]
        [--tokens 4096] [--repeat 20]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

import mixedopt
from mixedopt import _budget, _storage


def model(blocks: int, width: int, device: str) -> nn.Sequential:
    """The chain of blocks, the same for every variant."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(blocks):
        layers += [nn.LayerNorm(width), *[nn.Linear(width, width) for _ in range(4)]]
        layers += [nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU()]
        layers.append(nn.Linear(4 * width, width))
    return nn.Sequential(*layers).to(device)


@contextlib.contextmanager
def no_buckets() -> Iterator[None]:
    """Every gradient counts as too large for a bucket while the block runs."""
    saved = _budget.CPU_SMALL, _budget.ACCELERATOR_BUCKET_SMALL
    _budget.CPU_SMALL = _budget.ACCELERATOR_BUCKET_SMALL = 0
    try:
        yield
    finally:
        _budget.CPU_SMALL, _budget.ACCELERATOR_BUCKET_SMALL = saved


@contextlib.contextmanager
def every_cast() -> Iterator[None]:
    """The storage's ``cast_hook`` answers as if no weight could wait in a bucket."""
    original = _storage.GradientStorage.cast_hook

    def cast_hook(storage: Any, param: torch.Tensor, dtype: torch.dtype) -> Any:
        with no_buckets():
            return original(storage, param, dtype)

    _storage.GradientStorage.cast_hook = cast_hook  # type: ignore[method-assign]
    try:
        yield
    finally:
        _storage.GradientStorage.cast_hook = original  # type: ignore[method-assign]


class Variant:
    """An optimizer on its own copy of the model, the forward in its region, timed."""

    def __init__(
        self, make: Callable[[Any], Any], region: Callable[..., Any], casts: bool, args: Any
    ) -> None:
        self.net = model(args.blocks, args.width, args.device)
        self.opt = make(self.net.parameters())
        self.region, self.casts, self.device = region, casts, args.device
        self.times: dict[str, list[float]] = {"fwd+bwd": [], "step": [], "iteration": []}
        self.handed_over = 0

    def iteration(self, x: torch.Tensor) -> None:
        """Forward, backward and ``step()`` on ``x``, timed; the count of weights handed over."""
        sync = torch.cuda.synchronize if self.device.startswith("cuda") else (lambda: None)
        with every_cast() if self.casts else contextlib.nullcontext():
            sync()
            start = time.perf_counter()
            with self.region(self.device.split(":")[0], dtype=torch.float16):
                loss = self.net(x).float().square().mean()
            loss.backward()
            sync()
            middle = time.perf_counter()
            self.handed_over = self._handed_over()
            sync()
            before_step = time.perf_counter()
            self.opt.step()
            sync()
            end = time.perf_counter()
            self.opt.zero_grad()
        self.times["fwd+bwd"].append(middle - start)
        self.times["step"].append(end - before_step)
        self.times["iteration"].append(end - before_step + middle - start)

    def _handed_over(self) -> int:
        """Weights whose ``.grad`` is their product's 16-bit gradient: stored with no scale."""
        storage = getattr(self.opt, "_grad_storage", None)
        if storage is None:
            return 0
        weights = [m.weight for m in self.net if isinstance(m, nn.Linear)]
        return sum(w.grad is not None and storage.scale_of(w) is None for w in weights)

    def medians(self, skip: int) -> dict[str, float]:
        """Median milliseconds of each part, the first ``skip`` iterations left out."""
        return {key: statistics.median(v[skip:]) * 1e3 for key, v in self.times.items()}


def main() -> None:
    """Print the times of each variant, and the weights handed over."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--blocks", type=int, default=12, help="blocks (12)")
    parser.add_argument("--width", type=int, default=768, help="width of a block (768)")
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the input (4096)")
    parser.add_argument("--repeat", type=int, default=20, help="timed iterations (20)")
    args = parser.parse_args()
    variants = {
        "torch": Variant(lambda p: torch.optim.AdamW(p, foreach=True), torch.autocast, False, args),
        "mixedopt": Variant(mixedopt.AdamW, mixedopt.autocast, False, args),
        "mixedopt, every cast": Variant(mixedopt.AdamW, mixedopt.autocast, True, args),
    }
    x = torch.randn(args.tokens, args.width, device=args.device)
    warmup = 3
    for _ in range(warmup + args.repeat):
        for variant in variants.values():
            variant.iteration(x)
    weights = sum(isinstance(m, nn.Linear) for m in variants["torch"].net)
    params = sum(p.numel() for p in variants["torch"].net.parameters())
    print(
        f"{args.blocks} blocks of width {args.width} ({weights} weights, {params:,} parameters), "
        f"{args.tokens} tokens, on {args.device}, AdamW, float16, median of {args.repeat}, ms "
        "(ratio to torch):\n"
    )
    print("| variant | fwd+bwd | step | iteration | weights handed over |")
    print("|---|---:|---:|---:|---:|")
    reference = variants["torch"].medians(warmup)
    for name, variant in variants.items():
        medians = variant.medians(warmup)
        cells = [f"{medians[k]:.2f} ({medians[k] / reference[k]:.2f}x)" for k in reference]
        print(f"| {name} | " + " | ".join(cells) + f" | {variant.handed_over} of {weights} |")


if __name__ == "__main__":
    main()

"""What scaling a float32 gradient where it is saves a CPU's backward.

On a CPU, backward stores a float32 gradient above the bucket limit alone: it reads it for its
largest magnitude, then writes it scaled into 16 bits. A multiplication straight into a 16-bit
output computes into a float32 temporary of the gradient's size first, memory no cache holds;
a gradient nothing else holds is instead multiplied where it is, then rounded by a copy
(``_scales._scale_into``, ``owned``). Both round the same float32 products.

Two copies of the medium-tensors MLP (``mixedopt.bench.medium``: 256-512-512-512-10, batch 128,
autocast(float16), AdamW) take turns iteration by iteration, one storing as mixedopt does, the
other with every gradient treated as held elsewhere (the reference paths: one multiplication
into 16 bits, or pieces through the staging buffer above ``SCRATCH_PIECE`` elements). It prints,
per backward, the median time of the scaling calls and of forward and backward, and the median
of the paired differences (an iteration of one less the iteration of the other next to it).

    python scripts/scaling_in_place.py [--repeat 300] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
from torch import nn

import mixedopt
from mixedopt import _scales
from mixedopt.bench import medium

VARIANTS = ("in place", "reference")


def main() -> None:
    """Time both variants in turns and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    scale_into = _scales._scale_into
    scaling_time = [0.0]
    calls = [0]

    def timed(force_reference: bool) -> Callable[..., None]:
        def scale(stored, true, scale, scratch, owned) -> None:  # noqa: ANN001
            start = time.perf_counter()
            scale_into(stored, true, scale, scratch, owned and not force_reference)
            scaling_time[0] += time.perf_counter() - start
            calls[0] += 1

        return scale

    torch.manual_seed(0)
    x = torch.randn(medium.BATCH, medium.WIDTHS[0])
    y = torch.randint(0, medium.WIDTHS[-1], (medium.BATCH,))
    models = {name: medium.model() for name in VARIANTS}
    optimizers = {name: mixedopt.AdamW(models[name].parameters()) for name in VARIANTS}
    scaling: dict[str, list[float]] = {name: [] for name in VARIANTS}
    forward_backward: dict[str, list[float]] = {name: [] for name in VARIANTS}
    warm_up = 10
    for i in range(warm_up + args.repeat):
        for name in VARIANTS:
            _scales._scale_into = timed(force_reference=name == "reference")
            scaling_time[0], calls[0] = 0.0, 0
            start = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(models[name](x), y)
            loss.backward()
            elapsed = time.perf_counter() - start
            optimizers[name].step()
            optimizers[name].zero_grad()
            if i >= warm_up:
                scaling[name].append(scaling_time[0])
                forward_backward[name].append(elapsed)
    _scales._scale_into = scale_into

    print(
        f"Medium-tensors MLP, {calls[0]} gradients scaled per backward, {args.repeat} backwards "
        f"of each variant in turns, {args.threads} thread(s); medians, ms:"
    )
    print("| variant | scaling, per backward | forward and backward |")
    print("|---|---:|---:|")
    for name in VARIANTS:
        print(
            f"| {name} | {statistics.median(scaling[name]) * 1e3:.3f} "
            f"| {statistics.median(forward_backward[name]) * 1e3:.3f} |"
        )
    paired = [a - b for a, b in zip(*forward_backward.values(), strict=True)]
    print(f"in place less reference, paired: {statistics.median(paired) * 1e3:+.3f} ms")


if __name__ == "__main__":
    main()

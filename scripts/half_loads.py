"""Does the compiled Adam kernel read 16-bit gradients as fast as 32-bit ones?

Runs mixedopt's compiled Adam update (``mixedopt._compiled.adam_kernel``) on the same weights and
state, once with float16 gradients and once with float32 gradients, the two taking turns, and
prints the median time of each. A step with float16 gradients moves 26 bytes per element, with
float32 gradients 28: if memory traffic were all that counted, float16 would be 7% faster.

    python scripts/half_loads.py [--numel 2000000] [--params 16] [--repeat 40]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from mixedopt import _compiled


def main() -> None:
    """Time both and print the medians."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--params", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=40)
    args = parser.parse_args()

    torch.manual_seed(0)
    n = args.numel
    params = [torch.randn(n) for _ in range(args.params)]
    grads = {"float16": [torch.randn(n).half() * 1e-2 for _ in params]}
    grads["float32"] = [g.float() for g in grads["float16"]]
    exp_avgs = [torch.zeros(n) for _ in params]
    exp_avg_sqs = [torch.zeros(n) for _ in params]
    factor = torch.ones(())
    step_size, inverse = _compiled.adam_step_coefficients(1e-3, 0.9, 0.999, torch.zeros(1))
    coefficients = (step_size[0], inverse[0])
    shared = (None, *_compiled.scalars(0.1, 0.999, 0.001, 1e-8), None, None, True)

    def step(dtype: str) -> None:
        # One compiled call per parameter, as fused=True updates a large parameter.
        for p, g, m, v in zip(params, grads[dtype], exp_avgs, exp_avg_sqs, strict=True):
            _compiled.run(_compiled.adam_kernel, (p, g, factor, m, v, None, *coefficients, *shared))

    times: dict[str, list[float]] = {dtype: [] for dtype in grads}
    for dtype in grads:  # compile, then warm up
        for _ in range(3):
            step(dtype)
    for _ in range(args.repeat):
        for dtype in grads:
            start = time.perf_counter()
            step(dtype)
            times[dtype].append(time.perf_counter() - start)
    elements = n * len(params)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {elements:,} elements")
    for dtype, seconds in times.items():
        median = statistics.median(seconds)
        moved = (2 if dtype == "float16" else 4) + 24
        print(
            f"{dtype} gradients: {1e3 * median:.2f} ms, {moved} B/element, "
            f"{moved * elements / median / 1e9:.1f} GB/s"
        )


if __name__ == "__main__":
    main()

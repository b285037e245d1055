"""``loss.backward()`` inside a ``torch.compile``'d function, torch.optim next to mixedopt.

An MLP (32-64-64-8), AdamW, ``torch.compile(model)`` and a compiled training step that calls
``loss.backward()``; with ``--compiled-autograd`` also compiled autograd. Each run is a child
process with an empty Inductor cache, so that the first steps include compilation. Prints, per
library: the time of the first 12 steps, the median of the next ``--steady`` iterations, the
time of an iteration with nothing compiled (the default path's own ratio on this small model),
the graphs dynamo compiled, its recompile warnings, and how far mixedopt's weights are from
torch.optim's (largest relative difference of a weight tensor).

    python scripts/compiled_backward.py [--compiled-autograd] [--steady 200]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import json, statistics, sys, time, warnings
import torch
from torch import nn
from torch._dynamo.utils import counters
import mixedopt

library, compiled_autograd, steady, weights_path = sys.argv[1:]
torch.set_num_threads(1)
torch._dynamo.config.compiled_autograd = compiled_autograd == "1"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
optimizer_class = mixedopt.AdamW if library == "mixedopt" else torch.optim.AdamW
opt = optimizer_class(model.parameters(), lr=1e-3)
compiled_model = torch.compile(model)

@torch.compile
def train_step(x, y):
    loss = nn.functional.mse_loss(compiled_model(x), y)
    loss.backward()
    return loss

generator = torch.Generator().manual_seed(1)
batches = [(torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator))
           for _ in range(12)]

def iteration(x, y):
    opt.zero_grad()
    train_step(x, y)
    opt.step()

with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    start = time.perf_counter()
    for x, y in batches:
        iteration(x, y)
    first = time.perf_counter() - start
    torch.save([p.detach().clone() for p in model.parameters()], weights_path)
    times = []
    for i in range(int(steady)):
        start = time.perf_counter()
        iteration(*batches[i % 12])
        times.append(time.perf_counter() - start)
grad_dtype = str(model[0].weight.grad.dtype)


def eager_iteration(x, y):  # the default path's own ratio on this model, nothing compiled
    opt.zero_grad()
    nn.functional.mse_loss(model(x), y).backward()
    opt.step()

eager_times = []
for i in range(int(steady)):
    start = time.perf_counter()
    eager_iteration(*batches[i % 12])
    eager_times.append(time.perf_counter() - start)
print(json.dumps({
    "eager_ms": 1e3 * statistics.median(eager_times),
    "first_12_s": first,
    "steady_ms": 1e3 * statistics.median(times),
    "graphs": counters["stats"]["unique_graphs"],
    "recompile_warnings": sum("recompile" in str(w.message) for w in caught),
    "grad_dtype": grad_dtype,
}))
"""


def run(library: str, compiled_autograd: bool, steady: int, weights: str) -> dict:
    """One library's run, in a child process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache)
        args = [library, str(int(compiled_autograd)), str(steady), weights]
        done = subprocess.run(
            [sys.executable, "-c", CHILD, *args], env=env, capture_output=True, text=True
        )
    if done.returncode:
        raise SystemExit(done.stderr)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    """Run both libraries and print the comparison."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compiled-autograd", action="store_true")
    parser.add_argument("--steady", type=int, default=200, help="iterations timed after")
    args = parser.parse_args()

    import torch

    with tempfile.TemporaryDirectory() as folder:
        results = {}
        for library in ("torch.optim", "mixedopt"):
            weights = os.path.join(folder, library)
            results[library] = run(library, args.compiled_autograd, args.steady, weights)
        reference, ours = (
            torch.load(os.path.join(folder, "torch.optim")),
            torch.load(os.path.join(folder, "mixedopt")),
        )
    difference = max(
        float((p - q).abs().max() / q.abs().max()) for p, q in zip(ours, reference, strict=True)
    )
    pattern = "compiled autograd" if args.compiled_autograd else "backward in a compiled function"
    print(f"{pattern}, AdamW, MLP 32-64-64-8, batch 16, one thread")
    print()
    print("| | torch.optim | mixedopt | ratio |")
    print("|---|---:|---:|---:|")
    for key, label in (
        ("first_12_s", "first 12 steps (s)"),
        ("steady_ms", "then (ms/iter)"),
        ("eager_ms", "nothing compiled (ms/iter)"),
    ):
        a, b = results["torch.optim"][key], results["mixedopt"][key]
        print(f"| {label} | {a:.2f} | {b:.2f} | {b / a:.2f}x |")
    for key, label in (
        ("graphs", "graphs compiled"),
        ("recompile_warnings", "recompile warnings"),
        ("grad_dtype", "p.grad after 12 + steady steps"),
    ):
        print(f"| {label} | {results['torch.optim'][key]} | {results['mixedopt'][key]} | |")
    print()
    print(f"largest relative difference of a weight after 12 steps: {difference:.2e}")


if __name__ == "__main__":
    main()

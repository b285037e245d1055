"""Write the example notebooks of ``notebooks/`` from the cell sources in this file.

The notebooks are generated so that their code can be reviewed as plain Python. Usage, from the
repository root::

    python notebooks/build.py                # write the .ipynb files, without outputs
    python notebooks/build.py --execute      # write them, run them in full mode, save outputs
    python notebooks/build.py --smoke        # run them in smoke mode; write nothing

``--execute`` runs every notebook top to bottom in a fresh kernel of this interpreter with
``MIXEDOPT_SMOKE`` unset (full mode), saves them with their outputs, and the notebooks write the
exported figures into ``docs/``. Without it the files are written without outputs. ``--only
NAME`` restricts any of these to one notebook.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def _notebook(prefix: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook from ``(kind, source)`` pairs, with stable cell ids for readable diffs."""
    built = []
    for index, (kind, source) in enumerate(cells):
        text = textwrap.dedent(source).strip("\n")
        cell_id = f"{prefix}-{index:02d}"
        if kind == "md":
            built.append(new_markdown_cell(text, id=cell_id))
        else:
            built.append(new_code_cell(text, id=cell_id))
    notebook = new_notebook(cells=built)
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


# ------------------------------------------------------------------------------------------------
# 01: quickstart

QUICKSTART = [
    (
        "md",
        """
# Quickstart: float16 gradients for float32 weights

Under `torch.autocast(float16)` the forward and backward passes compute in float16, but
the weights stay float32 and so does every `.grad`: 4 bytes per parameter for values
that came out of float16 kernels. `mixedopt` keeps the gradients in float16 (2 bytes)
while weights and optimizer state stay float32.

The scenario: a small `Conv2d(3, 64, 3)` network trained under `autocast(float16)` on the
CPU with `RMSprop` and a `CosineAnnealingLR` schedule. The notebook shows

1. what goes wrong with the usual ways of getting float16 gradients (the real errors,
   caught and printed),
2. the one-line swap to `mixedopt.RMSprop`, and the dtypes of everything involved,
3. the recipe with `torch.amp.GradScaler` and `max_grad_norm`.

With the environment variable `MIXEDOPT_SMOKE=1` it runs a shortened version (smaller
batch, fewer steps).
""",
    ),
    (
        "code",
        """
import os
import time

import torch
from torch import nn
from torch.optim.lr_scheduler import CosineAnnealingLR

import mixedopt

SMOKE = os.environ.get("MIXEDOPT_SMOKE", "0") not in ("", "0")
STARTED = time.perf_counter()
BATCH = 8 if SMOKE else 32
STEPS = 3 if SMOKE else 20

torch.manual_seed(0)
print(
    f"torch {torch.__version__} | mixedopt {mixedopt.__version__} | "
    f"{torch.get_num_threads()} CPU threads | smoke mode: {SMOKE}"
)
""",
    ),
    (
        "code",
        """
def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 64, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(64, 64, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(64, 10),
    )


# A fixed batch of random 16x16 RGB images is enough to look at dtypes and errors.
images = torch.randn(BATCH, 3, 16, 16)
labels = torch.randint(0, 10, (BATCH,))
initial_weights = make_model().state_dict()


def fresh_model() -> nn.Module:
    \"\"\"The network, always from the same initial weights.\"\"\"
    model = make_model()
    model.load_state_dict(initial_weights)
    return model


def forward(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    \"\"\"Prediction and loss of the batch under autocast(float16) on the CPU.\"\"\"
    with torch.autocast("cpu", dtype=torch.float16):
        prediction = model(images)
        loss = nn.functional.cross_entropy(prediction, labels)
    return prediction, loss


def show_error(title: str, action) -> None:
    \"\"\"Run ``action`` and print the type and message of the exception it raises.\"\"\"
    print(title)
    try:
        action()
    except Exception as error:
        print(f"  -> {type(error).__name__}: {error}")
    else:
        print("  -> no error")
""",
    ),
    (
        "md",
        """
## The starting point: `torch.optim.RMSprop` under autocast

The convolutions run in float16, yet the gradients that land in `.grad` are float32,
because the weights are.
""",
    ),
    (
        "code",
        """
model = fresh_model()
optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
prediction, loss = forward(model)
loss.backward()
optimizer.step()

n_params = sum(p.numel() for p in model.parameters())
grad_bytes = sum(p.grad.nbytes for p in model.parameters())
print(f"{n_params:,} parameters")
print(f"prediction: {prediction.dtype}")
print(f"weights:    {model[0].weight.dtype}")
print(f"gradients:  {model[0].weight.grad.dtype}")
print(f"bytes held by gradients: {grad_bytes:,} ({grad_bytes / n_params:.0f} per parameter)")
""",
    ),
    (
        "md",
        """
## Attempt 1: a tensor hook that casts the gradient to float16

The answer usually given is `p.register_hook(lambda g: g.half())`. PyTorch does not let a
tensor hook change the dtype of a gradient, so the backward pass itself fails:
""",
    ),
    (
        "code",
        """
model = fresh_model()
for p in model.parameters():
    p.register_hook(lambda g: g.half())
show_error(
    "register_hook(lambda g: g.half()), then backward():",
    lambda: forward(model)[1].backward(),
)
""",
    ),
    (
        "md",
        """
## Attempt 2: `Tensor.grad_dtype`, with GradScaler

Since PyTorch 2.10 a leaf tensor has a `grad_dtype` attribute. With
`p.grad_dtype = torch.float16` the autograd engine casts every incoming gradient to
float16 before storing it, and that part works. The same answer usually adds "combine it
with GradScaler", since small float16 gradients flush to zero without loss scaling. But
GradScaler refuses to unscale float16 gradients, in `scaler.unscale_(optimizer)` and in
`scaler.step(optimizer)` alike:
""",
    ),
    (
        "code",
        """
def half_grad_setup() -> tuple[nn.Module, torch.optim.Optimizer, torch.amp.GradScaler]:
    \"\"\"A stock RMSprop whose parameters receive float16 gradients of a scaled loss.\"\"\"
    model = fresh_model()
    for p in model.parameters():
        p.grad_dtype = torch.float16
    optimizer = torch.optim.RMSprop(model.parameters(), lr=1e-3)
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(forward(model)[1]).backward()
    return model, optimizer, scaler


model, optimizer, scaler = half_grad_setup()
print("gradient dtypes after backward():", sorted({str(p.grad.dtype) for p in model.parameters()}))
show_error("scaler.unscale_(optimizer):", lambda: scaler.unscale_(optimizer))

model, optimizer, scaler = half_grad_setup()
show_error("scaler.step(optimizer):", lambda: scaler.step(optimizer))
""",
    ),
    (
        "md",
        """
## Attempt 3: float16 gradients straight into a stock optimizer

Without GradScaler, the stock optimizers expect gradients of the parameter's dtype.
`torch.optim.Adam` fails both in its default single-tensor path on the CPU and in its
`foreach` path. Other combinations fail silently instead: `SGD` with momentum runs, but
creates its momentum buffer in float16.
""",
    ),
    (
        "code",
        """
def half_grads(optimizer_class, **kwargs) -> torch.optim.Optimizer:
    \"\"\"A stock optimizer over fresh parameters holding float16 gradients.\"\"\"
    model = fresh_model()
    for p in model.parameters():
        p.grad_dtype = torch.float16
    optimizer = optimizer_class(model.parameters(), lr=1e-3, **kwargs)
    forward(model)[1].backward()
    return optimizer


for foreach in (None, True):
    optimizer = half_grads(torch.optim.Adam, foreach=foreach)
    show_error(f"torch.optim.Adam(foreach={foreach}).step() on float16 gradients:", optimizer.step)

optimizer = half_grads(torch.optim.SGD, momentum=0.9)
optimizer.step()
buffers = {str(s["momentum_buffer"].dtype) for s in optimizer.state.values()}
print(f"torch.optim.SGD(momentum=0.9) runs; its momentum buffers are {sorted(buffers)}")
""",
    ),
    (
        "md",
        """
## The swap: `mixedopt.RMSprop`

One line changes. `mixedopt.RMSprop` subclasses `torch.optim.RMSprop` and takes the same
arguments; the scheduler is used as before.
""",
    ),
    (
        "code",
        """
model = fresh_model()
optimizer = mixedopt.RMSprop(model.parameters(), lr=1e-3)  # was: torch.optim.RMSprop(...)
scheduler = CosineAnnealingLR(optimizer, T_max=STEPS)

losses, rates = [], []
for _ in range(STEPS):
    optimizer.zero_grad()
    prediction, loss = forward(model)
    loss.backward()
    optimizer.step()
    rates.append(scheduler.get_last_lr()[0])
    scheduler.step()
    losses.append(loss.item())

print("loss per step:         ", " ".join(f"{x:.3f}" for x in losses))
print("learning rate per step:", " ".join(f"{x:.1e}" for x in rates))
""",
    ),
    (
        "code",
        """
weight = model[0].weight
state = optimizer.state[weight]
dtypes = [
    ("data (images)", images.dtype),
    ("prediction (autocast output)", prediction.dtype),
    ("loss", loss.dtype),
    ("weight p", weight.dtype),
    ("gradient p.grad", weight.grad.dtype),
    ("optimizer.true_grad(p)", optimizer.true_grad(weight).dtype),
    ("optimizer state 'square_avg'", state["square_avg"].dtype),
    ("optimizer state 'step'", state["step"].dtype),
]
for name, dtype in dtypes:
    print(f"{name:<30} {dtype}")

grad_bytes = sum(p.grad.nbytes for p in model.parameters())
print(f"\\nbytes held by gradients: {grad_bytes:,} ({grad_bytes / n_params:.0f} per parameter)")
""",
    ),
    (
        "md",
        """
`p.grad` holds the true gradient times a per-tensor power of two, the *storage scale*,
chosen when the gradient is stored so that its largest magnitude lies in [128, 256):
small gradients do not flush to zero and large ones do not overflow. A power of two is
exact to apply and to undo. `optimizer.true_grad(p)` returns the true float32 gradient;
use it for logging and debugging, and do not hand `p.grad` itself to code that expects
true values (such as `clip_grad_norm_`: use `max_grad_norm`, below).
""",
    ),
    (
        "code",
        """
for name, p in model.named_parameters():
    true = optimizer.true_grad(p)
    stored_max = p.grad.abs().max().item()
    true_max = true.abs().max().item()
    exponent = round(torch.log2(torch.tensor(stored_max / true_max)).item())
    print(
        f"{name:<9} max |p.grad| {stored_max:7.2f}   max |true_grad(p)| {true_max:.3e}"
        f"   storage scale 2**{exponent}"
    )
""",
    ),
    (
        "md",
        """
The same run with `torch.optim.RMSprop` (float32 gradients), from the same initial
weights, for comparison:
""",
    ),
    (
        "code",
        """
reference = fresh_model()
reference_optimizer = torch.optim.RMSprop(reference.parameters(), lr=1e-3)
reference_scheduler = CosineAnnealingLR(reference_optimizer, T_max=STEPS)
reference_losses = []
for _ in range(STEPS):
    reference_optimizer.zero_grad()
    _, reference_loss = forward(reference)
    reference_loss.backward()
    reference_optimizer.step()
    reference_scheduler.step()
    reference_losses.append(reference_loss.item())

difference = max(
    (a - b).abs().max().item()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True)
)
loss_difference = max(abs(a - b) for a, b in zip(losses, reference_losses, strict=True))
print(f"largest loss difference over {STEPS} steps:    {loss_difference:.3e}")
print(f"largest weight difference after {STEPS} steps: {difference:.3e}")
""",
    ),
    (
        "md",
        """
Under autocast the weight gradients of convolutions and linear layers are computed by
float16 kernels, so they are float16 numbers already; scaled by a power of two they are
stored without loss, and the two runs match.

## GradScaler and gradient clipping

The recipe is the usual one: `scaler.scale(loss).backward()`, `scaler.step(optimizer)`,
`scaler.update()`. mixedopt optimizers declare that they handle loss scaling themselves,
so `scaler.step` hands them the loss scale and its inf/NaN flag instead of unscaling the
gradients (which it would refuse). Unscaling, clipping to `max_grad_norm` (over all
parameter groups, on the true gradients) and skipping a step with an inf or NaN happen
inside `step()`. `optimizer.last_grad_norm` is the norm before clipping and
`optimizer.skipped_steps` counts skipped steps.
""",
    ),
    (
        "code",
        """
model = fresh_model()
optimizer = mixedopt.RMSprop(model.parameters(), lr=1e-3, max_grad_norm=1.0)
scheduler = CosineAnnealingLR(optimizer, T_max=STEPS)
scaler = torch.amp.GradScaler("cpu")

print("step    loss   loss scale   last_grad_norm   skipped_steps")
for step in range(STEPS):
    optimizer.zero_grad()
    _, loss = forward(model)
    scaler.scale(loss).backward()
    loss_scale = scaler.get_scale()
    scaler.step(optimizer)
    scaler.update()
    scheduler.step()
    print(
        f"{step:>4} {loss.item():7.3f} {loss_scale:12.0f} "
        f"{optimizer.last_grad_norm.item():16.4f} {optimizer.skipped_steps:15d}"
    )
""",
    ),
    (
        "md",
        """
`true_grad(p)` undoes the storage scale only: it is the gradient of what `backward()`
was called on, here the scaled loss. Divided by the loss scale, its norm is the norm that
`step()` clipped. `scaler.unscale_(optimizer)` remains unavailable, because GradScaler
refuses float16 gradients before the optimizer is involved: clip with `max_grad_norm`
instead of `scaler.unscale_` followed by `clip_grad_norm_`.
""",
    ),
    (
        "code",
        """
norms = torch.stack([torch.linalg.vector_norm(optimizer.true_grad(p)) for p in model.parameters()])
true_norm = torch.linalg.vector_norm(norms).item()
print(f"norm of all true_grad(p) / loss scale: {true_norm / loss_scale:.4f}")
print(f"optimizer.last_grad_norm:              {optimizer.last_grad_norm.item():.4f}")
show_error("scaler.unscale_(optimizer) with mixedopt:", lambda: scaler.unscale_(optimizer))
""",
    ),
    (
        "md",
        """
## Summary

* Keep the model float32 and use `torch.autocast` as before; replace
  `torch.optim.RMSprop` (or `Adam`, `AdamW`, `SGD`) with its `mixedopt` namesake.
* `.grad` is float16, weights and optimizer state stay float32; the update is computed
  in float32 by torch's own functional update.
* With GradScaler use `scaler.step(optimizer)` and `max_grad_norm`, not
  `scaler.unscale_`.
* Read gradients through `optimizer.true_grad(p)`.
""",
    ),
    (
        "code",
        """
print(f"notebook ran in {time.perf_counter() - STARTED:.0f} s (smoke mode: {SMOKE})")
""",
    ),
]


# ------------------------------------------------------------------------------------------------
# 02: memory and speed

MEMORY = [
    (
        "md",
        """
# Memory and speed: torch.optim next to mixedopt

Per parameter, a training step keeps float32 weights (4 bytes), the gradients (4 bytes
with `torch.optim`, 2 with `mixedopt`) and the optimizer state (float32 in both), plus
temporaries that exist only while `step()` runs. This notebook

1. measures the persistent bytes on real optimizers after a step, by summing `nbytes`
   of the weights, the gradients and every tensor of the optimizer state;
2. runs the benchmark module `mixedopt.bench` (the same as `python -m mixedopt.bench`)
   for the peak memory of one step and the step times. Each variant's peak is measured
   in a fresh child process, from the resident-set high-water mark (`VmHWM`) of
   `/proc/self/status` after resetting it;
3. shows GPU numbers when a GPU run of the benchmark was saved to
   `docs/bench_gpu.json` (`python -m mixedopt.bench --device cuda --json
   docs/bench_gpu.json`).

`MIXEDOPT_SMOKE=1` shrinks the benchmark so that the notebook runs in well under two
minutes; the numbers are then only a smoke test.
""",
    ),
    (
        "code",
        """
import contextlib
import io
import json
import os
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from torch import nn

import mixedopt

%config InlineBackend.figure_format = 'png'
plt.rcParams["figure.dpi"] = 80

SMOKE = os.environ.get("MIXEDOPT_SMOKE", "0") not in ("", "0")
STARTED = time.perf_counter()
DOCS = Path("..") / "docs"
GPU_JSON = DOCS / "bench_gpu.json"

# The optimizers compared, with the benchmark's arguments: name -> (class name, kwargs).
OPTIMIZERS = {
    "rmsprop": ("RMSprop", {"lr": 1e-3}),
    "adam": ("Adam", {"lr": 1e-3}),
    "sgd": ("SGD", {"lr": 1e-3, "momentum": 0.9}),
}
LABELS = {"rmsprop": "RMSprop", "adam": "Adam", "sgd": "SGD, momentum 0.9"}
torch.manual_seed(0)
print(
    f"torch {torch.__version__} | mixedopt {mixedopt.__version__} | "
    f"{torch.get_num_threads()} CPU threads | smoke mode: {SMOKE}"
)
""",
    ),
    (
        "md",
        """
## Persistent bytes per parameter, measured

A small MLP trained one step under `autocast(float16)`, with each optimizer from
`torch.optim` and from `mixedopt`. The "state" column includes the 0-dim step counters,
which is why it is a hair above a whole number.
""",
    ),
    (
        "code",
        """
def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 10)
    )


inputs = torch.randn(64, 256)
targets = torch.randint(0, 10, (64,))
initial_weights = make_model().state_dict()


def persistent_bytes(library) -> dict[str, float]:
    \"\"\"Bytes per parameter held after one step, by kind, for each optimizer.\"\"\"
    found = {}
    for name, (class_name, kwargs) in OPTIMIZERS.items():
        model = make_model()
        model.load_state_dict(initial_weights)
        optimizer = getattr(library, class_name)(model.parameters(), **kwargs)
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.cross_entropy(model(inputs), targets)
        loss.backward()
        optimizer.step()
        params = list(model.parameters())
        numel = sum(p.numel() for p in params)
        state = [v for p in params for v in optimizer.state[p].values() if torch.is_tensor(v)]
        found[name] = {
            "weights": sum(p.nbytes for p in params) / numel,
            "gradients": sum(p.grad.nbytes for p in params) / numel,
            "state": sum(t.nbytes for t in state) / numel,
            "grad dtype": str(params[0].grad.dtype).removeprefix("torch."),
        }
    return found


measured = {"torch": persistent_bytes(torch.optim), "mixedopt": persistent_bytes(mixedopt)}
numel = sum(p.numel() for p in make_model().parameters())
print(f"MLP with {numel:,} parameters, bytes per parameter after one step\\n")
header = ["weights", "gradients", "state", "total"]
print(f"{'optimizer':<20} {'library':<12}", *(f"{h:>9}" for h in header), " grad dtype")
for name in OPTIMIZERS:
    for library in ("torch", "mixedopt"):
        row = measured[library][name]
        total = row["weights"] + row["gradients"] + row["state"]
        print(
            f"{LABELS[name]:<20} {library:<12} {row['weights']:9.2f} {row['gradients']:9.2f}"
            f" {row['state']:9.4f} {total:9.2f}  {row['grad dtype']}"
        )
""",
    ),
    (
        "md",
        """
## Peak temporaries and step time: `mixedopt.bench`

The benchmark builds float32 parameters, gives them gradients through a real `backward()`
and times `step()` alone, for

* `torch foreach`: `torch.optim.X(foreach=True)` on float32 gradients, the baseline of the
  ratios;
* `torch fused`: `torch.optim.X(fused=True)`, where torch has it;
* `mixedopt`: `mixedopt.X` with its defaults (float16 gradients);
* `mixedopt fused`: `mixedopt.X(fused=True)`, one compiled (`torch.compile`) pass per
  parameter; its second step compiles. Left out in smoke mode, where compiling would take
  most of the time.

"peak extra" is the memory one step needs beyond what is held before it. The full run uses a
single thread (`--threads 1`): on a 2-core machine shared with other work, two threads wait
on each other and the times scatter; drop the flag on a machine of your own.
""",
    ),
    (
        "code",
        """
VARIANTS = ["torch-foreach", "torch-fused", "mixedopt"]
if not SMOKE:
    VARIANTS.append("mixedopt-fused")
BENCH_ARGS = ["--device", "cpu", "--optimizers", ",".join(OPTIMIZERS)]
BENCH_ARGS += ["--variants", ",".join(VARIANTS)]
if SMOKE:
    BENCH_ARGS += ["--numel", "200000", "--params", "4", "--repeat", "3", "--warmup", "1"]
    BENCH_ARGS += ["--stream-mib", "16", "--no-iteration"]
else:
    BENCH_ARGS += ["--numel", "2000000", "--params", "16", "--repeat", "20", "--threads", "1"]

try:
    import mixedopt.bench as bench
except ImportError as error:
    bench = None
    print(
        f"mixedopt.bench cannot be imported ({error}): the benchmark sections below are "
        "skipped. Update mixedopt to a version that has `python -m mixedopt.bench`."
    )

cpu_run = None
if bench is not None:
    # docs/bench_cpu.json is the README's run (python -m mixedopt.bench --json ...): not this one.
    json_path = Path(tempfile.mkdtemp()) / "bench_cpu.json"
    print("python -m mixedopt.bench", " ".join(BENCH_ARGS), "--json", json_path, "\\n")
    with contextlib.redirect_stderr(io.StringIO()):  # no progress bar in the notebook
        status = bench.main([*BENCH_ARGS, "--json", str(json_path)])
    if status == 0 and json_path.exists():
        cpu_run = json.loads(json_path.read_text())
    else:
        print(f"the benchmark returned {status}; its sections below are skipped")
""",
    ),
    (
        "code",
        """
def by_optimizer(run: dict) -> dict[str, list[dict]]:
    \"\"\"The available rows of a benchmark run, by optimizer (those compared here).\"\"\"
    grouped = {name: [] for name in OPTIMIZERS}
    for row in run["rows"]:
        if row["optimizer"] in grouped and row["available"]:
            grouped[row["optimizer"]].append(row)
    return grouped


def library_of(row: dict) -> str:
    return "mixedopt" if row["variant"].startswith("mixedopt") else "torch"


def peak_per_param(row: dict, elements: int) -> tuple[float | None, str]:
    \"\"\"The step's peak extra bytes per parameter, and a prefix for its label.\"\"\"
    if row.get("peak_extra_bytes") is not None:
        return row["peak_extra_bytes"] / elements, ""
    if row.get("peak_extra_upper_bound") is not None:
        return row["peak_extra_upper_bound"] / elements, "<= "
    return None, ""


def breakdown(row: dict, measured_bytes: dict | None) -> dict[str, float]:
    \"\"\"Weights, gradients and state per parameter for one benchmark row.

    From this notebook's own measurement when given, else from the row itself (4-byte
    weights, the gradient's element size, the rest of its persistent bytes is state).
    \"\"\"
    if measured_bytes is not None:
        return {k: measured_bytes[k] for k in ("weights", "gradients", "state")}
    grad = 2 if row["grad_dtype"] in ("float16", "bfloat16") else 4
    return {
        "weights": 4.0,
        "gradients": float(grad),
        "state": row["persistent_bytes_per_param"] - 4.0 - grad,
    }


VARIANT_LABELS = {
    "torch-foreach": "torch\\nforeach",
    "torch-fused": "torch\\nfused",
    "mixedopt": "mixedopt",
    "mixedopt-fused": "mixedopt\\nfused",
}


def grouped_bars(ax, run: dict, draw) -> None:
    \"\"\"Lay out one bar per row, grouped by optimizer; ``draw(x, name, row)`` draws it.\"\"\"
    x, ticks, labels = 0.0, [], []
    for name, rows in by_optimizer(run).items():
        if not rows:
            continue
        for row in rows:
            draw(x, name, row)
            ticks.append(x)
            labels.append(VARIANT_LABELS.get(row["variant"], row["variant"]))
            x += 1
        middle = x - (len(rows) + 1) / 2
        transform = ax.get_xaxis_transform()
        ax.text(middle, -0.2, LABELS[name], transform=transform, ha="center", va="top", fontsize=9)
        x += 0.7
    ax.set_xticks(ticks, labels, fontsize=8)


COLORS = {
    "weights": "#9e9e9e",
    "gradients": "#1f77b4",
    "state": "#ff7f0e",
    "step() peak extra": "#d62728",
}


def plot_memory(ax, run: dict, use_measured: bool, title: str) -> None:
    \"\"\"Stacked bars of bytes per parameter: persistent parts and the step's peak extra.\"\"\"
    elements = run["config"]["numel"] * run["config"]["params"]

    def draw(x: float, name: str, row: dict) -> None:
        parts = breakdown(row, measured[library_of(row)][name] if use_measured else None)
        persistent = sum(parts.values())
        peak, prefix = peak_per_param(row, elements)
        parts["step() peak extra"] = peak or 0.0
        bottom = 0.0
        for kind, value in parts.items():
            hatch = "//" if kind == "step() peak extra" else None
            ax.bar(x, value, bottom=bottom, color=COLORS[kind], hatch=hatch, edgecolor="white")
            bottom += value
        peak_text = "peak n/a" if peak is None else f"+{prefix}{peak:.2f}"
        ax.text(x, bottom + 0.2, f"{persistent:.0f}\\n{peak_text}", ha="center", fontsize=7)

    grouped_bars(ax, run, draw)
    ax.set_ylabel("bytes per parameter")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.2)
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in COLORS.values()]
    ax.legend(handles, list(COLORS), fontsize=8, loc="upper left", ncol=4, frameon=False)


def plot_ratios(ax, run: dict, title: str) -> None:
    \"\"\"Bars of the median step time relative to torch foreach, grouped by optimizer.\"\"\"
    colors = {
        "torch-foreach": "#9e9e9e",
        "torch-fused": "#8c564b",
        "mixedopt": "#2ca02c",
        "mixedopt-fused": "#98df8a",
    }

    def draw(x: float, name: str, row: dict) -> None:
        ratio = row["ratio_to_foreach"]
        if ratio is None:
            return
        ax.bar(x, ratio, color=colors.get(row["variant"], "#17becf"))
        text = f"{ratio:.2f}x\\n{row['median_ms']:.3g} ms"
        ax.text(x, ratio, text, ha="center", va="bottom", fontsize=7)

    grouped_bars(ax, run, draw)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_ylabel("median step time / torch foreach")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.set_title(title, fontsize=10)


def print_rows(run: dict) -> None:
    for row in run["rows"]:
        if not row["available"]:
            print(f"  {row['optimizer']:<8} {row['variant']:<15} unavailable: {row['reason']}")
    for name, rows in by_optimizer(run).items():
        for row in rows:
            peak, prefix = peak_per_param(row, run["config"]["numel"] * run["config"]["params"])
            peak_text = "n/a" if peak is None else f"{prefix}{peak:.3f}"
            print(
                f"  {LABELS[name]:<18} {row['variant']:<15} {row['median_ms']:9.3f} ms "
                f"{row['ratio_to_foreach']:6.2f}x foreach   persistent "
                f"{row['persistent_bytes_per_param']:6.2f} B/param   peak extra {peak_text} B/param"
            )
""",
    ),
    (
        "code",
        """
if cpu_run is not None:
    machine, config = cpu_run["machine"], cpu_run["config"]
    elements = config["numel"] * config["params"]
    print_rows(cpu_run)
    print("\\npersistent bytes per parameter: this notebook's measurement (MLP) vs the benchmark's")
    for name, rows in by_optimizer(cpu_run).items():
        for row in rows:
            mine = sum(breakdown(row, measured[library_of(row)][name]).values())
            bench_value = row["persistent_bytes_per_param"]
            print(f"  {LABELS[name]:<18} {row['variant']:<15} {mine:6.2f} {bench_value:6.2f}")
    memory_figure, ax = plt.subplots(figsize=(10, 4.2))
    plot_memory(
        ax,
        cpu_run,
        use_measured=True,
        title=(
            f"Bytes per parameter, CPU ({machine['device_name']}); "
            f"step peak measured at {elements / 1e6:g}M parameters"
        ),
    )
    memory_figure.tight_layout()
    if not SMOKE:
        memory_figure.savefig(DOCS / "memory_per_param.png", dpi=110)
    plt.show()
""",
    ),
    (
        "md",
        """
The label on each bar gives the persistent bytes (weights + gradients + state) and, after the
`+`, the peak extra bytes of one step per parameter. With mixedopt the gradients take 2 bytes
instead of 4; weights and state are the same float32 tensors. torch's `foreach` paths of
RMSprop and Adam allocate temporaries as large as a whole state tensor while they step.
mixedopt's default path upcasts the gradients in slices of at most 1 Mi elements, so its peak
is a fixed few MiB whatever the model size (per parameter it shrinks as the model grows); the
fused kernels update each parameter in place.

## Step time

The median step time of each variant relative to `torch.optim` with `foreach=True` on the
same parameters; when the benchmark ran its training-iteration part (full mode), also a whole
iteration of an MLP under autocast (forward, backward, `step()`, `zero_grad()`) with AdamW. On
a CPU with 2 cores that other work shares, these numbers move from run to run: read them as
an order of magnitude.
""",
    ),
    (
        "code",
        """
def plot_iteration(ax, run: dict, title: str) -> None:
    \"\"\"Bars of the median training-iteration time relative to its first variant.\"\"\"
    results = run["iteration"]
    for x, result in enumerate(results):
        ax.bar(
            x, result["ratio"], color="#2ca02c" if "mixedopt" in result["variant"] else "#9e9e9e"
        )
        text = f"{result['ratio']:.2f}x\\n{result['median_ms']:.3g} ms"
        ax.text(x, result["ratio"], text, ha="center", va="bottom", fontsize=7)
    labels = [r["variant"].replace(" AdamW", "\\nAdamW") for r in results]
    ax.set_xticks(range(len(results)), labels, fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle=":")
    ax.set_ylabel(f"iteration time / {results[0]['variant']}", fontsize=8)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.set_title(title, fontsize=10)


if cpu_run is not None:
    iteration = bool(cpu_run.get("iteration"))
    figure, axes = plt.subplots(
        1,
        2 if iteration else 1,
        figsize=(13 if iteration else 9, 3.8),
        gridspec_kw={"width_ratios": [3, 1]} if iteration else None,
        squeeze=False,
    )
    plot_ratios(
        axes[0, 0],
        cpu_run,
        f"step(), CPU ({machine['device_name']}, torch threads: {machine['torch_threads']}), "
        f"{elements / 1e6:g}M parameters",
    )
    if iteration:
        plot_iteration(axes[0, 1], cpu_run, "Training iteration, MLP, AdamW")
    figure.tight_layout()
    plt.show()
    print(f"stream bandwidth of this machine: {machine['stream_bandwidth_gbps']:.1f} GB/s")
""",
    ),
    (
        "md",
        """
## Stepping in backward: no gradient held for the whole model

`with optimizer.step_in_backward(): loss.backward()` updates each bucket of parameters as
soon as backward has stored its gradients, and frees them: the same weights as
`loss.backward(); optimizer.step()`, without ever holding the gradients of the whole model.
`mixedopt.bench_in_backward` measures the peak of a training iteration (Adam, batch 1, so
that activations are negligible) in bytes per parameter: everything the model, its optimizer
and the iteration hold, weights (4 B) and Adam's state (8 B) included, each figure in a fresh
process, for three forwards. With a float32 forward the mode removes the 2 B of float16
gradients. Under `torch.autocast(float16)`, autocast keeps a float16 copy of every weight for
backward, which takes those 2 B at the start of backward in every mode. `mixedopt.autocast`
keeps none (backward casts each weight again when it needs it), so the mode's saving shows
under autocast too. The full run uses 64 x Linear(1024, 1024) (67M parameters); smoke mode uses
8 x Linear(512, 512), the two mixedopt modes and the float32 forward.
""",
    ),
    (
        "code",
        """
from mixedopt import bench_in_backward

if SMOKE:
    in_backward_size = {"layers": 8, "width": 512}
    in_backward_modes = [m for m in bench_in_backward.MEMORY_MODES if m.startswith("mixedopt")]
    forwards = ["float32"]
else:
    in_backward_size = {"layers": 64, "width": 1024}
    in_backward_modes = list(bench_in_backward.MEMORY_MODES)
    forwards = list(bench_in_backward.FORWARDS)
in_backward_memory = bench_in_backward.memory_table(
    **in_backward_size, modes=in_backward_modes, forwards=forwards
)
print(f"{'stepping':<36}", *(f"{f:>18}" for f in forwards))
for mode, found in in_backward_memory.items():
    cells = [f"{found[f].get('bytes_per_param', float('nan')):18.2f}" for f in forwards]
    print(f"{mode:<36}", *cells)

figure, ax = plt.subplots(figsize=(11, 3.6))
width = 0.8 / len(forwards)
for i, forward in enumerate(forwards):
    values = [found[forward].get("bytes_per_param", 0) for found in in_backward_memory.values()]
    xs = [x + (i - (len(forwards) - 1) / 2) * width for x in range(len(values))]
    bars = ax.bar(xs, values, width, label=f"forward: {forward}")
    ax.bar_label(bars, fmt="%.2f", fontsize=7)
ax.axhline(12, color="black", linewidth=0.8, linestyle=":", label="weights + Adam state")
labels = [mode.replace(", ", "\\n") for mode in in_backward_memory]
ax.set_xticks(range(len(labels)), labels, fontsize=8)
ax.set_ylabel("bytes per parameter at the peak", fontsize=8)
params = next(iter(in_backward_memory.values()))["float32"].get("params", 0)
ax.set_title(f"Peak of a training iteration, Adam, {params / 1e6:.0f}M parameters", fontsize=10)
ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
figure.tight_layout()
plt.show()
""",
    ),
    (
        "md",
        """
## GPU

Shown when `docs/bench_gpu.json`, the JSON output of a GPU run of the benchmark, exists. On a
GPU the peak is the CUDA caching allocator's own count (`torch.cuda.max_memory_allocated`),
and the persistent bytes come from the benchmark's rows.
""",
    ),
    (
        "code",
        """
if GPU_JSON.exists():
    gpu_run = json.loads(GPU_JSON.read_text())
    gpu_machine, gpu_config = gpu_run["machine"], gpu_run["config"]
    gpu_elements = gpu_config["numel"] * gpu_config["params"]
    label = f"GPU: {gpu_machine['device_name']}"
    print(f"{label} | torch {gpu_machine['torch_version']} | {gpu_elements / 1e6:g}M parameters")
    print_rows(gpu_run)
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(10, 8))
    plot_memory(top, gpu_run, use_measured=False, title=f"Bytes per parameter, {label}")
    plot_ratios(bottom, gpu_run, f"Step time relative to torch foreach, {label}")
    figure.tight_layout()
    plt.show()
    if gpu_run.get("iteration"):
        figure, ax = plt.subplots(figsize=(4.5, 3.4))
        plot_iteration(ax, gpu_run, f"Training iteration, MLP, AdamW, {label}")
        figure.tight_layout()
        plt.show()
else:
    print(
        f"No GPU results: {GPU_JSON} does not exist. On a machine with a GPU, run\\n"
        "  python -m mixedopt.bench --device cuda --json docs/bench_gpu.json\\n"
        "from the repository root, then run this notebook again."
    )
""",
    ),
    (
        "code",
        """
print(f"notebook ran in {time.perf_counter() - STARTED:.0f} s (smoke mode: {SMOKE})")
""",
    ),
]


# ------------------------------------------------------------------------------------------------
# 03: numerics and convergence

NUMERICS = [
    (
        "md",
        """
# Numerics and convergence

Two questions about float16 gradients:

1. **Does training converge the same?** A small CNN learns scikit-learn's digits
   dataset (8x8 images of handwritten digits, shipped with scikit-learn) under
   `autocast(float16)` on the CPU, three times from the same initial weights and with
   the same batches: with `torch.optim.Adam`, with `mixedopt.Adam`, and with
   `mixedopt.Adam` under `torch.amp.GradScaler`.
2. **How precise are the stored gradients?** For loss scales from 1e-6 to 1e3, the
   relative error of each gradient tensor when the float32 gradient is simply rounded to
   float16, and when mixedopt stores it, against a float32 reference from the same batch.

`MIXEDOPT_SMOKE=1` trains for a fraction of an epoch and uses fewer loss scales.
""",
    ),
    (
        "code",
        """
import copy
import os
import statistics
import time
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display
from sklearn.datasets import load_digits
from sklearn.model_selection import train_test_split
from torch import nn

import mixedopt

%config InlineBackend.figure_format = 'png'
plt.rcParams["figure.dpi"] = 80

SMOKE = os.environ.get("MIXEDOPT_SMOKE", "0") not in ("", "0")
STARTED = time.perf_counter()
DOCS = Path("..") / "docs"
EPOCHS = 1 if SMOKE else 12
STEPS_PER_EPOCH = 8 if SMOKE else None  # None: the whole training split
BATCH = 64
LR = 3e-3
LOSS_SCALES = [1e-6, 1e-3, 1.0, 1e3] if SMOKE else [10.0**k for k in range(-6, 4)]

torch.manual_seed(0)
print(
    f"torch {torch.__version__} | mixedopt {mixedopt.__version__} | "
    f"{torch.get_num_threads()} CPU threads | smoke mode: {SMOKE}"
)
""",
    ),
    (
        "code",
        """
digits = load_digits()
features = torch.tensor(digits.images, dtype=torch.float32).unsqueeze(1) / 16.0
targets = torch.tensor(digits.target)
train_x, test_x, train_y, test_y = train_test_split(
    features, targets, test_size=0.25, stratify=targets, random_state=0
)
print(
    f"train {tuple(train_x.shape)}, test {tuple(test_x.shape)}, classes {len(digits.target_names)}"
)


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 2 * 2, 10),
    )


initial_weights = make_model().state_dict()
print(f"{sum(p.numel() for p in make_model().parameters()):,} parameters")
""",
    ),
    (
        "md",
        """
## Training three times

Same initial weights, same batch order; only the optimizer (and GradScaler) differ.
""",
    ),
    (
        "code",
        """
def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        return (model(x).argmax(dim=1) == y).float().mean().item()


def train(optimizer_class, use_scaler: bool) -> dict:
    \"\"\"Train a fresh copy of the model; return its losses, accuracy and gradients.\"\"\"
    model = make_model()
    model.load_state_dict(initial_weights)
    optimizer = optimizer_class(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu") if use_scaler else None
    order = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(EPOCHS):
        permutation = torch.randperm(len(train_x), generator=order)
        batches = permutation.split(BATCH)[:STEPS_PER_EPOCH]
        for indices in batches:
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(train_x[indices]), train_y[indices])
            if scaler is None:
                loss.backward()
                optimizer.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            losses.append(loss.item())
    grads = [p.grad for p in model.parameters()]
    return {
        "model": model,
        "losses": losses,
        "test accuracy": accuracy(model, test_x, test_y),
        "train accuracy": accuracy(model, train_x, train_y),
        "grad dtype": str(grads[0].dtype).removeprefix("torch."),
        "grad bytes": sum(g.nbytes for g in grads),
        "skipped steps": getattr(optimizer, "skipped_steps", 0),
        "loss scale": scaler.get_scale() if scaler is not None else None,
    }


runs = {}
for label, optimizer_class, use_scaler in [
    ("torch.optim.Adam", torch.optim.Adam, False),
    ("mixedopt.Adam", mixedopt.Adam, False),
    ("mixedopt.Adam + GradScaler", mixedopt.Adam, True),
]:
    runs[label] = train(optimizer_class, use_scaler)
    print(f"{label:<28} {len(runs[label]['losses'])} steps")
""",
    ),
    (
        "code",
        """
def smooth(values: list[float], window: int) -> list[float]:
    \"\"\"Trailing moving average.\"\"\"
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


window = 1 if SMOKE else 10
reference_losses = runs["torch.optim.Adam"]["losses"]
figure, (left, right) = plt.subplots(1, 2, figsize=(11, 3.8))
styles = {
    "torch.optim.Adam": {"color": "#9e9e9e", "linewidth": 4.0},
    "mixedopt.Adam": {"color": "#1f77b4", "linewidth": 1.6},
    "mixedopt.Adam + GradScaler": {"color": "#d62728", "linewidth": 1.0, "linestyle": "--"},
}
for label, run in runs.items():
    left.plot(smooth(run["losses"], window), label=label, **styles[label])
    if label != "torch.optim.Adam":
        difference = [a - b for a, b in zip(run["losses"], reference_losses, strict=True)]
        right.plot(difference, label=label, **{**styles[label], "linewidth": 1.0})
left.set_yscale("log")
left.set_xlabel("step")
left.set_ylabel(f"training loss (moving average of {window})")
left.set_title(f"Digits CNN under autocast(float16), Adam(lr={LR:g})", fontsize=10)
left.legend(fontsize=8)
right.axhline(0.0, color="black", linewidth=0.6)
right.set_xlabel("step")
right.set_ylabel("loss - loss of torch.optim.Adam")
right.set_title("Difference from the torch.optim run, per step", fontsize=10)
right.legend(fontsize=8)
figure.tight_layout()
plt.show()
""",
    ),
    (
        "code",
        """
columns = ["optimizer", "test accuracy", "train accuracy", "final loss (mean of last 10)"]
columns += ["largest loss difference from torch.optim", "gradient dtype", "gradient bytes"]
columns += ["skipped steps"]
lines = ["| " + " | ".join(columns) + " |", "|---|---:|---:|---:|---:|---|---:|---:|"]
for label, run in runs.items():
    final_loss = statistics.mean(run["losses"][-10:])
    gap = max(abs(a - b) for a, b in zip(run["losses"], reference_losses, strict=True))
    lines.append(
        f"| {label} | {100 * run['test accuracy']:.2f}% | {100 * run['train accuracy']:.2f}% "
        f"| {final_loss:.4f} | {gap:.1e} | {run['grad dtype']} | {run['grad bytes']:,} "
        f"| {run['skipped steps']} |"
    )
display(Markdown("\\n".join(lines)))
scaled = runs["mixedopt.Adam + GradScaler"]
print(f"GradScaler's final loss scale: {scaled['loss scale']:.0f}")
""",
    ),
    (
        "md",
        """
The test split is the 25% of the 1,797 images held out (stratified by class). With the
same initial weights and batches, the `torch.optim` and `mixedopt` runs match (see the
loss difference in the table): the weight gradients of the convolutions and of the linear
layer come out of float16 kernels under autocast, so they are float16 numbers already, and
mixedopt's power-of-two storage scale keeps them exactly. GradScaler changes the arithmetic
of the backward pass (every gradient is computed multiplied by the loss scale), so that run
drifts apart slowly, as any two float16 runs would; it skips a step whenever the scaled
gradients overflow, and then lowers its scale.

## Gradient precision across loss scales

For one batch of the trained model, computed in **float32** (no autocast, so that the
only difference between the methods is how the gradient is stored), the loss is
multiplied by a loss scale `s` and three gradients are compared per parameter tensor:

* **reference**: the float32 gradient from `torch.autograd.grad` (which mixedopt does
  not touch), from the same forward pass;
* **plain float16**: the reference rounded to float16 and back, `g.half().float()`,
  which is what a plain float16 `.grad` holds;
* **mixedopt**: `optimizer.true_grad(p)` after `backward()` of the same loss, with the
  parameters managed by `mixedopt.Adam`.

The error of a tensor is `‖stored − reference‖₂ / ‖reference‖₂`; the plot shows the
largest over the model's tensors. Plain bfloat16 (`g.bfloat16().float()`) is drawn for
comparison: its range is that of float32, but it keeps 8 significant bits instead of 11.
""",
    ),
    (
        "code",
        """
def relative_error(stored: torch.Tensor, reference: torch.Tensor) -> float:
    return (
        torch.linalg.vector_norm(stored - reference) / torch.linalg.vector_norm(reference)
    ).item()


probe = copy.deepcopy(runs["torch.optim.Adam"]["model"])  # plain torch parameters
names = [name for name, _ in probe.named_parameters()]
params = list(probe.parameters())
probe_optimizer = mixedopt.Adam(params, lr=LR)  # manages how probe's .grad is stored
batch_x, batch_y = train_x[:256], train_y[:256]

errors = {"plain float16": [], "mixedopt float16": [], "plain bfloat16": []}
per_tensor = {}  # loss scale -> method -> per-tensor errors
flushed = []  # fraction of nonzero reference entries that become 0 in plain float16
magnitudes = []  # largest |gradient| over all tensors, per loss scale
for scale in LOSS_SCALES:
    probe_optimizer.zero_grad()
    loss = nn.functional.cross_entropy(probe(batch_x), batch_y) * scale
    references = torch.autograd.grad(loss, params, retain_graph=True)
    loss.backward()
    stored = {
        "plain float16": [r.half().float() for r in references],
        "mixedopt float16": [probe_optimizer.true_grad(p) for p in params],
        "plain bfloat16": [r.bfloat16().float() for r in references],
    }
    per_tensor[scale] = {
        method: [relative_error(s, r) for s, r in zip(values, references, strict=True)]
        for method, values in stored.items()
    }
    for method in errors:
        errors[method].append(max(per_tensor[scale][method]))
    nonzero = sum(int((r != 0).sum()) for r in references)
    zeros = sum(int(((r != 0) & (r.half() == 0)).sum()) for r in references)
    flushed.append(zeros / nonzero)
    magnitudes.append(max(r.abs().max().item() for r in references))
probe_optimizer.remove_grad_storage()

header = ["max |grad|", "plain fp16", "mixedopt", "plain bf16", "flushed to 0"]
print(f"{'loss scale':>10}", *(f"{h:>12}" for h in header))
for i, scale in enumerate(LOSS_SCALES):
    print(
        f"{scale:10.0e} {magnitudes[i]:12.1e} {errors['plain float16'][i]:12.2e} "
        f"{errors['mixedopt float16'][i]:12.2e} {errors['plain bfloat16'][i]:12.2e} "
        f"{100 * flushed[i]:11.1f}%"
    )
""",
    ),
    (
        "code",
        """
precision_figure, ax = plt.subplots(figsize=(7.5, 4.5))
line_styles = {
    "plain float16": {"color": "#d62728", "marker": "o"},
    "mixedopt float16": {"color": "#1f77b4", "marker": "s"},
    "plain bfloat16": {"color": "#7f7f7f", "marker": "^", "linestyle": "--"},
}
labels = {
    "plain float16": "plain float16: g.half()",
    "mixedopt float16": "mixedopt float16: optimizer.true_grad(p)",
    "plain bfloat16": "plain bfloat16: g.bfloat16()",
}
for method, values in errors.items():
    ax.plot(LOSS_SCALES, values, label=labels[method], **line_styles[method])
ax.set_xscale("log")
ax.set_yscale("log")
ax.set_xlabel("loss scale")
ax.set_ylabel("relative L2 error of the gradient\\n(largest over the model's tensors)")
ax.set_title("Gradient precision vs loss scale: digits CNN, float32 reference", fontsize=10)
ax.grid(True, which="major", linewidth=0.4, alpha=0.6)
ax.legend(fontsize=8)
precision_figure.tight_layout()
if not SMOKE:
    precision_figure.savefig(DOCS / "gradient_precision.png", dpi=110)
plt.show()
""",
    ),
    (
        "code",
        """
smallest = LOSS_SCALES[0]
print(f"per-tensor relative error at loss scale {smallest:.0e}")
print(f"{'tensor':<10} {'numel':>6} {'plain fp16':>11} {'mixedopt':>10}")
for i, (name, p) in enumerate(zip(names, params, strict=True)):
    print(
        f"{name:<10} {p.numel():6d} {per_tensor[smallest]['plain float16'][i]:11.2e} "
        f"{per_tensor[smallest]['mixedopt float16'][i]:10.2e}"
    )
""",
    ),
    (
        "md",
        """
With a small loss scale (or simply small gradients, late in training or deep in a
network) the plain float16 copy loses most entries to underflow: float16 has no numbers
below about 6e-8, and only a few bits of precision below 6e-5. mixedopt multiplies each
tensor by a power of two before rounding, so its error stays at the float16 rounding
floor (a few times 1e-4) at every loss scale. Above float16's largest value (65504) plain
float16 gradients become inf; mixedopt scales them down instead.
""",
    ),
    (
        "code",
        """
print(f"notebook ran in {time.perf_counter() - STARTED:.0f} s (smoke mode: {SMOKE})")
""",
    ),
]


NOTEBOOKS = {
    "01_quickstart.ipynb": ("qs", QUICKSTART),
    "02_memory_and_speed.ipynb": ("mem", MEMORY),
    "03_numerics_and_convergence.ipynb": ("num", NUMERICS),
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name``, without outputs."""
    prefix, cells = NOTEBOOKS[name]
    return _notebook(prefix, cells)


def execute(notebook: nbformat.NotebookNode, smoke: bool, timeout: int = 1200) -> float:
    """Run ``notebook`` in place in a fresh kernel of this interpreter; return the seconds."""
    from nbclient import NotebookClient

    env = dict(os.environ)
    env.pop("MIXEDOPT_SMOKE", None)
    if smoke:
        env["MIXEDOPT_SMOKE"] = "1"
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets a debugger warning
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    )
    started = time.perf_counter()
    client.execute(env=env)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Command line: write, and optionally execute, the notebooks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--execute", action="store_true", help="run in full mode, save outputs")
    mode.add_argument("--smoke", action="store_true", help="run in smoke mode, save nothing")
    parser.add_argument("--only", choices=list(NOTEBOOKS), action="append", help="one notebook")
    args = parser.parse_args(argv)
    for name in args.only or list(NOTEBOOKS):
        notebook, path = build(name), HERE / name
        if args.smoke:
            print(f"{name}: smoke run {execute(notebook, smoke=True):.0f} s", flush=True)
            continue
        if args.execute:
            seconds = execute(notebook, smoke=False)
            print(f"{name}: full run {seconds:.0f} s", flush=True)
        nbformat.write(notebook, path)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

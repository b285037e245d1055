"""The cells of ``02_memory_and_speed.ipynb``: memory and speed, torch.optim next to mixedopt.

The notebook teaches where the bytes per parameter of a training step go (float32 weights,
gradients, optimizer state, and the temporaries of ``step()``) and what float16 gradients save:

1. the persistent bytes of real optimizers after a step, summed from ``nbytes``;
2. the peak extra bytes of one step and the step-time ratios, from ``mixedopt.bench`` (each
   variant's peak measured in a fresh child process); a full run exports the bytes plot to
   ``docs/memory_per_param.png``;
3. ``optimizer.step_in_backward()``, which never holds the gradients of the whole model, from
   ``mixedopt.bench.in_backward``;
4. the GPU figures, when a GPU run of the benchmark was saved to ``docs/bench_gpu.json``.

``MEMORY`` holds its cells as ``(kind, source)`` pairs, ``kind`` being ``"md"`` or ``"code"``;
``build.py`` writes the notebook from them.
"""

from cells_common import PLOTTING_PREAMBLE, RUN_TIME, SEED_AND_VERSIONS

MEMORY: list[tuple[str, str]] = [
    (
        "md",
        """
# Memory and speed: torch.optim next to mixedopt

Per parameter, a training step keeps float32 weights (4 bytes), the gradients (4 bytes
with `torch.optim`, 2 with `mixedopt`) and the optimizer state (float32 in both), plus
temporaries that exist only while `step()` runs. This notebook

1. measures the persistent bytes on real optimizers after a step, by summing `nbytes`
   of the weights, the gradients and every tensor of the optimizer state;
2. runs the benchmark module `mixedopt.bench.steps` (the same as `python -m mixedopt.bench`)
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

"""
        + PLOTTING_PREAMBLE
        + """
GPU_JSON = DOCS / "bench_gpu.json"

# The optimizers compared, with the benchmark's arguments: name -> (class name, kwargs).
OPTIMIZERS = {
    "rmsprop": ("RMSprop", {"lr": 1e-3}),
    "adam": ("Adam", {"lr": 1e-3}),
    "sgd": ("SGD", {"lr": 1e-3, "momentum": 0.9}),
}
LABELS = {"rmsprop": "RMSprop", "adam": "Adam", "sgd": "SGD, momentum 0.9"}
"""
        + SEED_AND_VERSIONS,
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
    from mixedopt.bench import steps as bench
except ImportError as error:
    bench = None
    print(
        f"mixedopt.bench.steps cannot be imported ({error}): the benchmark sections below are "
        "skipped. Update mixedopt to a version that has the `mixedopt.bench` subpackage."
    )

cpu_run = None
if bench is not None:
    # docs/bench_cpu.json is the performance page's run (mixedopt.bench --json ...): not this.
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

`with optimizer.step_in_backward(): loss.backward()` updates the parameters during backward,
as soon as their stored gradients reach 4Mi elements (8 MiB), and frees those gradients: the
same weights as `loss.backward(); optimizer.step()`, without ever holding the gradients of the
whole model.
`mixedopt.bench.in_backward` measures the peak of a training iteration (Adam, batch 1, so
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
from mixedopt.bench import in_backward as bench_in_backward

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
    RUN_TIME,
]

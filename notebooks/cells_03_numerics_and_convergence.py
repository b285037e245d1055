"""The cells of ``03_numerics_and_convergence.ipynb``: numerics and convergence.

The notebook teaches two things about float16 gradients:

1. training converges the same: a small CNN learns scikit-learn's digits under
   ``autocast(float16)`` three times from the same weights and batches, with
   ``torch.optim.Adam``, ``mixedopt.Adam`` and ``mixedopt.Adam`` under ``torch.amp.GradScaler``;
2. how precise the stored gradients are: for loss scales from 1e-6 to 1e3, the relative error
   of plain float16 rounding and of mixedopt's scaled storage against a float32 reference
   (a full run exports the plot to ``docs/gradient_precision.png``).

``NUMERICS`` holds its cells as ``(kind, source)`` pairs, ``kind`` being ``"md"`` or
``"code"``; ``build.py`` writes the notebook from them.
"""

from cells_common import PLOTTING_PREAMBLE, RUN_TIME, SEED_AND_VERSIONS

NUMERICS: list[tuple[str, str]] = [
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

"""
        + PLOTTING_PREAMBLE
        + """
EPOCHS = 1 if SMOKE else 12
STEPS_PER_EPOCH = 8 if SMOKE else None  # None: the whole training split
BATCH = 64
LR = 3e-3
LOSS_SCALES = [1e-6, 1e-3, 1.0, 1e3] if SMOKE else [10.0**k for k in range(-6, 4)]

"""
        + SEED_AND_VERSIONS,
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
# Short headings, so that the table fits the page's width; the text below says what each is.
columns = ["optimizer", "test acc.", "train acc.", "final loss", "max loss gap", ".grad dtype"]
columns += [".grad bytes", "skipped"]
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
In the table, the final loss is the mean of the last 10 steps' losses, the max loss gap the
largest difference from the loss of `torch.optim.Adam` at the same step, and skipped the
steps skipped for an inf or NaN gradient. The test split is the 25% of the 1,797 images held
out (stratified by class). With the
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
    RUN_TIME,
]

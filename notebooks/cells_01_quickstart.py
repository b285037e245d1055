"""The cells of ``01_quickstart.ipynb``: float16 gradients for float32 weights.

The notebook trains a small ``Conv2d(3, 64, 3)`` network under ``autocast(float16)`` on the CPU
with ``RMSprop`` and a ``CosineAnnealingLR`` schedule. It teaches

1. why the usual ways of getting float16 gradients fail: a ``register_hook`` that casts the
   gradient, ``Tensor.grad_dtype`` with ``GradScaler``, float16 gradients in a stock optimizer
   (the real errors, caught and printed);
2. the one-line swap to ``mixedopt.RMSprop``, the dtypes of data, prediction, gradient, weight
   and state, the storage scale and ``optimizer.true_grad(p)``;
3. the recipe with ``torch.amp.GradScaler`` and ``max_grad_norm`` instead of ``scaler.unscale_``.

``QUICKSTART`` holds its cells as ``(kind, source)`` pairs, ``kind`` being ``"md"`` or
``"code"``; ``build.py`` writes the notebook from them.
"""

from cells_common import RUN_TIME, SEED_AND_VERSIONS, SMOKE_AND_CLOCK

QUICKSTART: list[tuple[str, str]] = [
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

"""
        + SMOKE_AND_CLOCK
        + """
BATCH = 8 if SMOKE else 32
STEPS = 3 if SMOKE else 20

"""
        + SEED_AND_VERSIONS,
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
chosen when the gradient is stored so that its largest magnitude lies in [128, 256] (in
[128, 256) before the float16 rounding):
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
    RUN_TIME,
]

"""Small models and training loops shared by the tests."""

from __future__ import annotations

import contextlib
import copy
import json
import os
import subprocess
import sys
import textwrap

import torch
from hypothesis import strategies as st
from torch import nn

import mixedopt
import mixedopt._budget
import mixedopt._in_backward

# The optimizers with mixedopt's compiled kernels (``fused=True``): most tests run on these.
OPTIMIZERS = {
    "RMSprop": (mixedopt.RMSprop, torch.optim.RMSprop),
    "Adam": (mixedopt.Adam, torch.optim.Adam),
    "AdamW": (mixedopt.AdamW, torch.optim.AdamW),
    "SGD": (mixedopt.SGD, torch.optim.SGD),
}
# Every optimizer: the parity properties, PyTorch's configurations and the signatures run on all.
EVERY_OPTIMIZER = {
    **OPTIMIZERS,
    **{
        name: (getattr(mixedopt, name), getattr(torch.optim, name))
        for name in (
            "ASGD",
            "Adadelta",
            "Adafactor",
            "Adagrad",
            "Adamax",
            "Muon",
            "NAdam",
            "RAdam",
            "Rprop",
        )
    },
}
# Those whose fused=True is torch's own fused update (no compiled kernels of mixedopt's).
TORCH_FUSED_ONLY = ("Adagrad",)


def small_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 10), nn.Tanh(), nn.Linear(10, 3))


def twin(model: nn.Module) -> nn.Module:
    """An independent copy of ``model`` with the same weights."""
    return copy.deepcopy(model)


def autocast_backward(model: nn.Module, x: torch.Tensor, loss_scale: float = 1.0) -> torch.Tensor:
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean() * loss_scale
    loss.backward()
    return loss.detach()


def fp32_grads(model: nn.Module, x: torch.Tensor, loss_scale: float = 1.0) -> list[torch.Tensor]:
    """The float32 gradients autograd gives for the same loss as ``autocast_backward``."""
    params = list(model.parameters())
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(x).float().square().mean() * loss_scale
    return list(torch.autograd.grad(loss, params))


def params_of(shapes, seed=0):
    """Parameters of the given shapes, of standard normal values (the same for a seed)."""
    generator = torch.Generator().manual_seed(seed)
    return [nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]


def backward_of_magnitudes(params, magnitudes, seed):
    """One backward of sum(p * g), ``g`` of the given magnitude for each parameter."""
    generator = torch.Generator().manual_seed(seed)
    loss = 0
    for p, magnitude in zip(params, magnitudes, strict=True):
        loss = loss + (p * (torch.randn(p.shape, generator=generator) * 10.0**magnitude)).sum()
    loss.backward()


def step_both_on_the_same_gradients(opt, ref, params, reference, steps=3):
    """``steps`` steps of ``opt`` and ``ref`` on the same random float32 gradients, assigned by
    hand (mixedopt takes those as true gradients)."""
    for _ in range(steps):
        for p, q in zip(params, reference, strict=True):
            q.grad = torch.randn(p.shape)
            p.grad = q.grad.clone()
        opt.step()
        ref.step()


# float32 noise: two computations of the same value with other kernels (torch's for-loop update
# where mixedopt runs the foreach one, fused=True's compiled kernels, a sum in another order)
# differ by a few float32 roundings of the largest term.
NOISE_ULPS = 4
EPS32 = 2.0**-23


def assert_close_to_float32_noise(mine, theirs, ulps=NOISE_ULPS, msg=None):
    """``mine`` equals ``theirs`` but for ``ulps`` float32 roundings of each element and of the
    largest magnitude in ``theirs`` (where cancellation leaves a small result). A tolerance
    relative to the values compared: a fixed one would pass anything at 1e-6 and below."""
    theirs = torch.as_tensor(theirs)
    finite = theirs.detach()[theirs.detach().isfinite()]
    largest = finite.abs().max().item() if finite.numel() else 0.0
    tolerance = ulps * EPS32
    torch.testing.assert_close(
        mine, theirs, rtol=tolerance, atol=tolerance * largest, equal_nan=True, msg=msg
    )


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    exact = exact.double()
    denominator = torch.linalg.vector_norm(exact)
    if denominator == 0:
        return float(torch.linalg.vector_norm(approx.double()))
    return float(torch.linalg.vector_norm(approx.double() - exact) / denominator)


SHAPES = st.lists(
    st.sampled_from([(), (0,), (1,), (5,), (3, 4), (2, 3, 2), (17,), (64,)]), min_size=1, max_size=4
)
MATRICES = st.lists(st.sampled_from([(1, 1), (3, 4), (8, 5), (2, 16)]), min_size=1, max_size=3)
# torch.optim.Adafactor divides by a parameter's number of elements (ZeroDivisionError on an empty
# one, in every implementation, torch 2.13).
NON_EMPTY = st.lists(
    st.sampled_from([(), (1,), (5,), (3, 4), (2, 3, 2), (17,), (64,)]), min_size=1, max_size=4
)
LR = st.floats(min_value=1e-4, max_value=0.1)
WEIGHT_DECAY = st.sampled_from([0.0, 1e-2])
BETAS = st.tuples(st.floats(0.5, 0.95), st.floats(0.9, 0.9999))  # Adam's and its kin's
EPS = st.sampled_from([1e-8, 1e-3])


@st.composite
def hyperparameters(draw, name):
    foreach = draw(st.sampled_from([None, False, True]))
    maximize = draw(st.booleans())
    if name == "RMSprop":
        return dict(
            lr=draw(LR),
            alpha=draw(st.floats(min_value=0.5, max_value=0.999)),
            eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY),
            momentum=draw(st.sampled_from([0.0, 0.9])),
            centered=draw(st.booleans()),
            foreach=foreach,
            maximize=maximize,
        )
    if name in ("Adam", "AdamW"):
        return dict(
            lr=draw(LR),
            betas=draw(BETAS),
            eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY),
            amsgrad=draw(st.booleans()),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Adamax":
        return dict(
            lr=draw(LR),
            betas=draw(BETAS),
            eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Adafactor":
        return dict(
            lr=draw(LR),
            beta2_decay=draw(st.sampled_from([-0.8, -0.5])),
            eps=(draw(st.sampled_from([None, 1e-30])), draw(st.sampled_from([1e-3, 1e-2]))),
            d=draw(st.sampled_from([1.0, 2.0])),
            weight_decay=draw(WEIGHT_DECAY),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Muon":  # no foreach and no maximize in torch.optim.Muon
        return dict(
            lr=draw(LR),
            weight_decay=draw(st.sampled_from([0.0, 0.1])),
            momentum=draw(st.sampled_from([0.0, 0.95])),
            nesterov=draw(st.booleans()),
            ns_steps=draw(st.sampled_from([5, 2])),
            adjust_lr_fn=draw(st.sampled_from([None, "original", "match_rms_adamw"])),
        )
    if name == "NAdam":
        return dict(
            lr=draw(LR),
            betas=draw(BETAS),
            eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY),
            momentum_decay=draw(st.sampled_from([4e-3, 0.1])),
            decoupled_weight_decay=draw(st.booleans()),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "ASGD":
        return dict(
            lr=draw(LR),
            lambd=draw(st.sampled_from([1e-4, 1e-2])),
            alpha=draw(st.floats(0.5, 1.0)),
            t0=draw(st.sampled_from([1e6, 1.0])),  # averaging from the first steps, or never
            weight_decay=draw(WEIGHT_DECAY),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "RAdam":
        return dict(
            lr=draw(LR),
            betas=draw(BETAS),
            eps=draw(EPS),
            weight_decay=draw(WEIGHT_DECAY),
            decoupled_weight_decay=draw(st.booleans()),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Adagrad":
        return dict(
            lr=draw(LR),
            lr_decay=draw(st.sampled_from([0.0, 1e-2])),
            weight_decay=draw(WEIGHT_DECAY),
            initial_accumulator_value=draw(st.sampled_from([0.0, 0.1])),
            eps=draw(st.sampled_from([1e-10, 1e-3])),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Adadelta":
        return dict(
            lr=draw(st.sampled_from([1.0, 0.1])),
            rho=draw(st.floats(0.5, 0.99)),
            eps=draw(st.sampled_from([1e-6, 1e-3])),
            weight_decay=draw(WEIGHT_DECAY),
            foreach=foreach,
            maximize=maximize,
        )
    if name == "Rprop":
        return dict(
            lr=draw(LR),
            etas=(draw(st.floats(0.3, 0.9)), draw(st.floats(1.1, 1.5))),
            step_sizes=(draw(st.sampled_from([1e-6, 1e-4])), draw(st.sampled_from([1.0, 50.0]))),
            foreach=foreach,
            maximize=maximize,
        )
    momentum = draw(st.sampled_from([0.0, 0.9]))
    nesterov = momentum > 0 and draw(st.booleans())
    return dict(
        lr=draw(LR),
        momentum=momentum,
        dampening=0.0 if nesterov else draw(st.sampled_from([0.0, 0.3])),
        nesterov=nesterov,
        weight_decay=draw(WEIGHT_DECAY),
        foreach=foreach,
        maximize=maximize,
    )


@st.composite
def scenarios(draw):
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    return dict(
        name=name,
        kwargs=draw(hyperparameters(name)),
        shapes=draw(SHAPES),
        magnitudes=draw(st.lists(st.floats(-9, 6), min_size=1, max_size=4)),
        steps=draw(st.integers(1, 4)),
        packing=draw(st.sampled_from([1 << 20, 7, 1, *ACCELERATOR_BUDGETS])),
        seed=draw(st.integers(0, 2**16)),
    )


@contextlib.contextmanager
def setting(owner, name, value):
    """``owner.name`` set to ``value`` for the block, then back to what it was."""
    saved = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, saved)


def slice_elements(n):
    """Make step() cut the gradients into slices of ``n`` elements (on the CPU)."""
    return setting(mixedopt._budget, "CPU_CAPACITY", n)


# Accelerators' budgets, small enough for small tensors, given to the CPU: every branch mixedopt
# takes on an accelerator (the four-launch store of a gradient alone, buckets rounded in one
# multiplication, buckets joined into the step's batches or parameters cut into pieces, the
# skip decided on the device by fused=True) runs on the CPU. Gradients of more than 16 elements
# are stored alone.
ACCELERATOR_BUDGETS = {
    "accelerator, joined batches": mixedopt._budget.accelerator_budget(128, 16, 16, 1 << 20),
    "accelerator, pieces of 40": mixedopt._budget.accelerator_budget(128, 16, 16, 40),
}


def accelerator_budget(name="accelerator, joined batches"):
    """Give the CPU an accelerator's budget for the block (``ACCELERATOR_BUDGETS``)."""
    return setting(mixedopt._budget, "CPU_BUDGET", ACCELERATOR_BUDGETS[name])


def packing(choice):
    """The CPU's budget for the block: slices of ``choice`` elements, or an accelerator's."""
    if isinstance(choice, int):
        return slice_elements(choice)
    return accelerator_budget(choice)


def update_batch(n):
    """Make an updating backward update what waits once ``n`` elements of gradients wait."""
    return setting(mixedopt._in_backward, "UPDATE_BATCH", n)


class Twins:
    """The same parameters under ``fused=True`` and under a reference path: the same mixedopt
    optimizer on its default path, unless ``reference`` builds another (from the parameters
    and the scenario's keyword arguments). Both get their gradients from the same backward.
    (Parity with torch.optim itself: ``parity.Trio``.)
    """

    def __init__(self, name, kwargs, shapes, seed, reference=None, **extra):
        generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        data = [torch.randn(shape, generator=generator) for shape in shapes]
        self.params = [nn.Parameter(d.clone()) for d in data]
        self.ref_params = [nn.Parameter(d.clone()) for d in data]
        mixed_cls = OPTIMIZERS[name][0]
        self.opt = mixed_cls(self.params, **kwargs, **extra)
        self.ref = (reference or mixed_cls)(self.ref_params, **kwargs)
        self.largest = {}  # id of a reference tensor -> largest magnitude it has held

    def backward(self, magnitude):
        """One backward on each side, of gradients of ``10**magnitude`` (the same on both)."""
        grads = [
            torch.randn(p.shape, generator=self.generator) * 10.0**magnitude for p in self.params
        ]
        for params in (self.params, self.ref_params):
            sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()

    def zero_grad(self):
        self.opt.zero_grad()
        self.ref.zero_grad()

    def assert_equal(self, ulps=NOISE_ULPS):
        """Weights and state equal to the reference's but for float32 noise: ``ulps`` float32
        roundings of each element and of the largest magnitude its tensor has held so far
        (kernels that round like the reference but fuse a multiply-add where it does not, or
        the reverse, differ by an ulp of the largest term, which cancellation can make large
        next to a small result).
        """
        for p, q in zip(self.params, self.ref_params, strict=True):
            pairs = [(p, q)]
            mixed_state, ref_state = self.opt.state[p], self.ref.state[q]
            assert mixed_state.keys() == ref_state.keys()
            for key, value in ref_state.items():
                if torch.is_tensor(value):
                    assert mixed_state[key].dtype == value.dtype == torch.float32
                    assert mixed_state[key].shape == value.shape
                pairs.append((mixed_state[key], value))
            for mine, theirs in pairs:
                largest = 0.0
                if torch.is_tensor(theirs) and theirs.numel() > 0:
                    key = id(theirs)
                    largest = max(self.largest.get(key, 0.0), theirs.detach().abs().max().item())
                    self.largest[key] = largest
                tolerance = ulps * EPS32
                torch.testing.assert_close(mine, theirs, rtol=tolerance, atol=tolerance * largest)


# The start of a child process that measures peak resident memory (Linux): ``status(key)`` reads
# VmRSS or VmHWM in bytes, and ``reset_peak()`` writes 5 to clear_refs, which resets the peak
# (VmHWM) to the current resident size.
PEAK_PRELUDE = textwrap.dedent(
    """
    import json, sys, torch, mixedopt

    def status(key):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024

    def reset_peak():
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    """
)


def peak_in_child(script, *args):
    """Run ``PEAK_PRELUDE + script`` in a new interpreter; the ``extra`` it prints as JSON.

    Large allocations go straight to mmap (and back to the system when freed), so that resident
    memory follows what is allocated.
    """
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    result = subprocess.run(
        [sys.executable, "-c", PEAK_PRELUDE + textwrap.dedent(script), *map(str, args)],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])["extra"]


def sgd_with_a_pass_more(params):
    """mixedopt.SGD whose step() ends with one more operation over every parameter.

    What the launch and byte counts must see: one launch and 8 bytes per element more.
    """
    optimizer = mixedopt.SGD(params, lr=0.1, foreach=True)
    step = optimizer.step

    def step_and_touch():
        step()
        for p in params:
            p.detach().add_(0)

    optimizer.step = step_and_touch
    return optimizer

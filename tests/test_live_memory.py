"""What stays alive between steps: weights, gradients, state, and a stated constant beyond them.

Every tensor storage alive after training iterations (forward, backward, ``step()``), found
through the garbage collector (``gc.get_objects()``, each storage counted once), in a child
process of its own, so that nothing another test left behind is counted (the cases of one
child run one after the other: what one leaves behind counts in the next). The iteration's
inputs and the weights, gradients (their buffers) and optimizer state are set aside; the rest
is what the library holds beyond them, which ``_budget.HELD_BETWEEN_STEPS`` and
``HELD_PER_TENSOR`` bound. torch.optim holds nothing beyond them: the count sets aside exactly
what it should, and a tensor kept beyond them is found. And a model whose optimizer is gone
is let go of.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch
from torch import nn

import mixedopt
from mixedopt._budget import HELD_BETWEEN_STEPS, HELD_PER_TENSOR

slow = pytest.mark.slow  # child processes

# Prints, per case, the bytes every live storage takes and what weights, gradients and state take.
CHILD = textwrap.dedent(
    """
    import gc, json, sys
    import torch
    from torch import nn
    import mixedopt

    MODELS = {
        "64 x Linear(64, 64)": (lambda: [nn.Linear(64, 64) for _ in range(64)], 16, 64),
        "MLP 256-512-512-512-10": (
            lambda: [
                nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(),
                nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10),
            ],
            128,
            256,
        ),
        "64 x Linear(128, 128)": (lambda: [nn.Linear(128, 128) for _ in range(64)], 16, 128),
    }
    KWARGS = {"SGD": {"lr": 0.01, "momentum": 0.9}, "RMSprop": {"lr": 1e-3}, "Adam": {"lr": 1e-3}}
    KEPT = []  # what the case "kept" holds beyond weights, gradients and state
    UPDATE_BATCH = mixedopt._in_backward.UPDATE_BATCH


    def storages(tensors):
        found = {}
        for t in tensors:
            if t is None or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            try:
                found[(storage.device, storage.data_ptr())] = storage.nbytes()
            except RuntimeError:  # torch.compile's fake tensors: no memory
                pass
        return found


    def live():
        gc.collect()
        return storages(o for o in gc.get_objects() if issubclass(type(o), torch.Tensor))


    def measure(model_name, library, name, mode, fused, forward):
        make, batch, width = MODELS[model_name]
        torch.manual_seed(0)
        model = nn.Sequential(*make())
        params = list(model.parameters())
        kwargs = dict(KWARGS[name])
        if mode == "step_in_backward, batches":  # several updates in each backward
            mixedopt._in_backward.UPDATE_BATCH = 1 << 16
        if library.startswith("torch"):
            flag = {"fused": True} if fused else {"foreach": True}
            opt = getattr(torch.optim, name)(params, **flag, **kwargs)
        else:
            opt = getattr(mixedopt, name)(params, fused=fused, **kwargs)
        x = torch.randn(batch, width)
        y = torch.randn(batch, params[-1].shape[0])
        for _ in range(3):  # state made, compiled kernels compiled, buffers at their size
            if forward == "mixedopt.autocast":
                context = mixedopt.autocast("cpu", dtype=torch.float16)
            else:
                context = torch.autocast("cpu", enabled=False)
            with context:
                loss = nn.functional.mse_loss(model(x).float(), y)
            if mode.startswith("step_in_backward"):
                with opt.step_in_backward():
                    loss.backward()
            else:
                opt.zero_grad()
                loss.backward()
                opt.step()
            del loss
        if library == "torch, kept":
            KEPT.append(torch.zeros(1 << 10))
        found = live()
        held = storages([x, y])
        weights = storages(params)
        grads = storages(p.grad for p in params)
        state = storages(
            t for s in opt.state.values() for t in s.values() if isinstance(t, torch.Tensor)
        )
        known = {**held, **weights, **grads, **state}
        beyond = {k: n for k, n in found.items() if k not in known}
        return {
            "params": sum(p.numel() for p in params),
            "tensors": len(params),
            "live": sum(n for k, n in found.items() if k not in held),
            "weights": sum(weights.values()),
            "grads": sum(grads.values()),
            "state": sum(state.values()),
            "beyond": sum(beyond.values()),
            "largest": sorted(beyond.values(), reverse=True)[:4],
        }


    results = []
    for case in json.loads(sys.argv[1]):
        results.append({"case": case, **measure(*case)})
        mixedopt._in_backward.UPDATE_BATCH = UPDATE_BATCH
        gc.collect()
    print(json.dumps(results))
    """
)


def measure(cases):
    """Run ``cases`` (model, library, optimizer, mode, fused, forward) in one child process."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(cases)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


MODELS = ["64 x Linear(64, 64)", "MLP 256-512-512-512-10", "64 x Linear(128, 128)"]
OPTIMIZERS = ["Adam", "SGD", "RMSprop"]
MODES = ["step", "step_in_backward", "step_in_backward, batches"]


def cases(model, fused):
    return [
        [model, "mixedopt", name, mode, fused, "float32"] for name in OPTIMIZERS for mode in MODES
    ]


def bound(result):
    return HELD_BETWEEN_STEPS + HELD_PER_TENSOR * result["tensors"]


def assert_within_the_constant(results):
    assert len(results) > 1
    over = [r for r in results if r["beyond"] > bound(r)]
    assert not over, [(r["case"], r["beyond"], bound(r), r["largest"]) for r in over]


@slow
@pytest.mark.parametrize("model", MODELS)
def test_between_steps_mixedopt_holds_weights_gradients_state_and_the_constant(model):
    assert_within_the_constant(measure(cases(model, fused=False)))


@slow
@pytest.mark.parametrize("model", MODELS)
def test_between_fused_steps_mixedopt_holds_weights_gradients_state_and_the_constant(model):
    assert_within_the_constant(measure(cases(model, fused=True)))


@slow
def test_under_mixedopt_autocast_too():
    model = "MLP 256-512-512-512-10"
    assert_within_the_constant(
        measure(
            [
                [model, "mixedopt", "Adam", mode, fused, "mixedopt.autocast"]
                for mode in MODES
                for fused in (False, True)
            ]
        )
    )


@slow
def test_the_count_sets_aside_exactly_what_torch_optim_holds():
    """torch.optim holds weights, gradients and state, nothing beyond: the count finds 0."""
    torch_cases = [[m, "torch", n, "step", False, "float32"] for m in MODELS for n in OPTIMIZERS]
    results = measure(torch_cases)
    assert [r["beyond"] for r in results] == [0] * len(results)
    assert all(r["live"] == r["weights"] + r["grads"] + r["state"] for r in results)


@slow
def test_the_count_finds_a_tensor_kept_beyond_weights_gradients_and_state():
    (result,) = measure([[MODELS[0], "torch, kept", "Adam", "step", False, "float32"]])
    assert result["beyond"] == 4 << 10


@pytest.mark.parametrize("in_backward", [False, True])
def test_a_model_whose_optimizer_is_gone_is_let_go_of(in_backward):
    """Without a process group, no slot of a released parameter stays in the storage."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))
    opt = mixedopt.Adam(model.parameters())
    loss = model(torch.randn(4, 8)).square().mean()
    if in_backward:
        with opt.step_in_backward():
            loss.backward()
    else:
        loss.backward()
        opt.step()
    weight = weakref.ref(model[0].weight)
    del model, opt, loss
    gc.collect()
    assert weight() is None

"""Backward under torch.compile, and optimizers let go of while something traces or runs."""

from __future__ import annotations

import gc
import threading
import warnings

import pytest
import torch
from helpers import assert_close_to_float32_noise
from parity import round_gradients_as_stored
from torch import nn
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

import mixedopt

STEPS = 12
BACKEND = "aot_eager"


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)
    )


def train(optimizer_class, compiled_autograd: bool, rounded: bool = False):
    """``STEPS`` steps of the issue's pattern: ``loss.backward()`` inside a compiled function.

    ``rounded``: the gradients rounded as the storage documents before each step (a torch.optim
    reference for mixedopt's float16 gradients). Returns the optimizer, the warnings and the
    number of graphs dynamo compiled.
    """
    torch._dynamo.reset()
    counters.clear()
    model = mlp()
    opt = optimizer_class(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    # torch.compile reads compiled_autograd when it wraps a function.
    with (
        torch._dynamo.config.patch(compiled_autograd=compiled_autograd),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        compiled_model = torch.compile(model, backend=BACKEND)

        @torch.compile(backend=BACKEND)
        def train_step(x, y):
            loss = nn.functional.mse_loss(compiled_model(x), y)
            loss.backward()
            return loss

        for _ in range(STEPS):
            opt.zero_grad()
            x, y = torch.randn(16, 32, generator=generator), torch.randn(16, 8, generator=generator)
            train_step(x, y)
            if rounded:
                round_gradients_as_stored(model.parameters())
            opt.step()
    return opt, [str(w.message) for w in caught], counters["stats"]["unique_graphs"]


def params(opt):
    return opt.param_groups[0]["params"]


def assert_same_weights(opt, reference):
    for p, q in zip(params(opt), params(reference), strict=True):
        assert_close_to_float32_noise(p, q)


def test_backward_inside_a_compiled_function_gives_torch_optims_weights():
    opt, _, _ = train(mixedopt.AdamW, compiled_autograd=False)
    reference, _, _ = train(torch.optim.AdamW, compiled_autograd=False, rounded=True)
    assert_same_weights(opt, reference)
    assert all(p.grad.dtype == torch.float16 for p in params(opt))


def test_backward_inside_a_compiled_function_compiles_only_what_torch_optim_does():
    _, caught, graphs = train(mixedopt.AdamW, compiled_autograd=False)
    _, _, reference_graphs = train(torch.optim.AdamW, compiled_autograd=False)
    assert graphs == reference_graphs
    assert not [message for message in caught if "recompile" in message]


def test_compiled_autograd_gives_torch_optims_weights_with_float32_gradients():
    opt, caught, _ = train(mixedopt.AdamW, compiled_autograd=True)
    reference, _, _ = train(torch.optim.AdamW, compiled_autograd=True)
    assert_same_weights(opt, reference)
    # Traced as doing nothing, the hooks leave autograd's float32 gradients, and say so once.
    assert all(p.grad.dtype == torch.float32 for p in params(opt))
    assert len([message for message in caught if "compiled autograd" in message]) == 1
    assert not [message for message in caught if "recompile" in message]


def test_the_compiled_autograd_flag_without_float32_gradients_gives_no_warning():
    # torch.compile reads the flag when it wraps a function: one wrapped before the flag is set
    # keeps the storage's hooks, and every gradient arrives in float16. The warning is for
    # gradients that reached step() in float32, not for the flag.
    model = mlp()
    opt = mixedopt.AdamW(model.parameters(), lr=1e-3)

    @torch.compile(backend=BACKEND)
    def train_step(x, y):
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    with (
        torch._dynamo.config.patch(compiled_autograd=True),
        warnings.catch_warnings(record=True) as caught,
    ):
        warnings.simplefilter("always")
        for _ in range(2):
            opt.zero_grad()
            train_step(torch.randn(16, 32), torch.randn(16, 8))
            assert all(p.grad.dtype == torch.float16 for p in params(opt))
            opt.step()
    assert not [w for w in caught if "compiled autograd" in str(w.message)]


def test_compiled_autograd_compiles_only_what_torch_optim_does():
    _, _, graphs = train(mixedopt.AdamW, compiled_autograd=True)
    _, _, reference_graphs = train(torch.optim.AdamW, compiled_autograd=True)
    assert graphs == reference_graphs


@pytest.fixture
def collector_off():
    """The garbage collector runs only where a test calls it."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def drop_in_a_cycle(param: nn.Parameter) -> None:
    """Create an optimizer holding ``param`` and drop it in a reference cycle: only the garbage
    collector frees it. It has stored a gradient (the storage has its buffers)."""
    opt = mixedopt.AdamW([param], lr=1e-3)
    opt.cycle = opt
    (param * 2).sum().backward()
    assert param.grad.dtype == torch.float16


def test_an_optimizer_collected_inside_a_trace_is_let_go_after_it(collector_off):
    # Inside a trace, the tensors a release would make (the stored gradient's float32 copy, the
    # storage's buffers) are the trace's fakes: it waits, here until the next construction.
    param = nn.Parameter(torch.randn(100))
    drop_in_a_cycle(param)
    with FakeTensorMode():
        gc.collect()
    assert param.grad.dtype == torch.float16  # not let go inside the trace
    other = nn.Parameter(torch.randn(100))
    opt = mixedopt.AdamW([other], lr=1e-3)
    assert param not in opt._grad_storage
    assert torch.equal(param.grad, torch.full((100,), 2.0))
    (other * 3).sum().backward()  # nothing of the trace left in the shared storage
    assert torch.equal(opt.true_grad(other), torch.full((100,), 3.0))


def test_an_optimizer_collected_on_another_thread_is_let_go_there(collector_off):
    # The storage's bookkeeping is guarded (docs/design.md, "Who owns what"): a release may run
    # on any thread, and does so at once where no backward holds its gradients.
    param, other = nn.Parameter(torch.randn(100)), nn.Parameter(torch.randn(100))
    opt = mixedopt.AdamW([other], lr=1e-3)
    drop_in_a_cycle(param)
    collector = threading.Thread(target=gc.collect)
    collector.start()
    collector.join()
    assert param not in opt._grad_storage
    assert torch.equal(param.grad, torch.full((100,), 2.0))
    (other * 3).sum().backward()
    opt.step()
    assert torch.equal(opt.true_grad(other), torch.full((100,), 3.0))


@pytest.mark.parametrize("shape", [(100,), (2000, 1000)], ids=["in a bucket", "stored alone"])
def test_an_optimizer_collected_while_a_hook_takes_a_gradient_is_let_go_after_it(
    shape, monkeypatch, collector_off
):
    param = nn.Parameter(torch.randn(100))
    other = nn.Parameter(torch.randn(shape))
    opt = mixedopt.AdamW([other], lr=1e-3)
    drop_in_a_cycle(param)
    storage = opt._grad_storage
    name = "_store_alone" if len(shape) == 2 else "_store_bucket"
    original = getattr(storage, name)

    def collect_then_store(*args, **kwargs):
        monkeypatch.setattr(storage, name, original)  # once
        gc.collect()
        assert param in storage  # waits for the storage work under way
        return original(*args, **kwargs)

    monkeypatch.setattr(storage, name, collect_then_store)
    (other * 3).sum().backward()
    assert param not in storage
    assert torch.equal(param.grad, torch.full((100,), 2.0))
    assert torch.equal(opt.true_grad(other), torch.full(shape, 3.0))

"""Numeric parity with torch.optim fed autograd's own float32 gradients (``parity.Trio``).

Every property compares mixedopt with torch.optim twice: fed the twin backward's gradients
rounded as docs/grad.md documents (float32 noise apart), and fed them as they are (within the
documented rounding, carried through the update).
"""

from __future__ import annotations

import io

import pytest
import torch
from helpers import EVERY_OPTIMIZER, OPTIMIZERS, slice_elements
from hypothesis import given
from hypothesis import strategies as st
from parity import (
    UNIT,
    Trio,
    gradient_tensors,
    loss_with_gradients,
    run_scenario,
    scenarios,
    stored_as_documented,
)
from torch import nn
from torch.func import functional_call


@given(
    st.floats(-9, 6),
    st.sampled_from([0, 3, 8]),
    st.sampled_from([torch.float16, torch.bfloat16]),
    st.integers(0, 2**16),
)
def test_the_documented_rounding_is_within_a_unit_of_the_largest_magnitude(
    magnitude, spread, grad_dtype, seed
):
    """And of each element itself, down to 2**-21 of the largest (docs/grad.md)."""
    generator = torch.Generator().manual_seed(seed)
    (grad,) = gradient_tensors([(257,)], [magnitude], spread, generator)
    error = (stored_as_documented(grad, grad_dtype) - grad).abs()
    largest = grad.abs().max().item()
    assert error.max().item() <= UNIT[grad_dtype] * largest
    normal = grad.abs() >= largest * 2.0**-21
    assert (error[normal] <= UNIT[grad_dtype] * grad.abs()[normal]).all()


@given(scenarios())
def test_step_matches_torch_optim_fed_autograds_gradients(s):
    run_scenario(s)


@given(scenarios("fused"))
def test_fused_step_matches_torch_optim_fed_autograds_gradients(s):
    run_scenario(s, "fused")


@given(scenarios("step_in_backward"))
def test_step_in_backward_matches_torch_optim_fed_autograds_gradients(s):
    run_scenario(s, "step_in_backward")


@given(scenarios(), st.sampled_from(["default", "fused", "step_in_backward"]))
def test_the_first_momentum_buffer_is_each_gradient_rounded_as_documented(s, path):
    """Element by element, bitwise: SGD's first momentum buffer is the gradient it is fed. The
    other comparisons allow float32 noise relative to each tensor's largest magnitude, under
    which a different rounding of its smallest elements (float16's subnormal numbers) hides."""
    s.update(
        name="SGD",
        kwargs={"lr": 0.1, "momentum": 0.9, "foreach": s["kwargs"].get("foreach")},
        steps=1,
        max_grad_norm=None,  # a coefficient from a norm summed in another order
        non_finite=None,
    )
    if path == "fused":
        s["kwargs"]["foreach"] = None
    if path == "step_in_backward":
        s["loss_scale"] = None
    trio = run_scenario(s, path)
    for p, q in zip(trio.mixed.params, trio.rounded.params, strict=True):
        mine, theirs = trio.mixed.opt.state[p], trio.rounded.opt.state[q]
        assert torch.equal(mine["momentum_buffer"], theirs["momentum_buffer"])


def mlp_under_autocast(seed=0):
    """A model and its micro-batches' losses, each a function of a side's parameters: the
    model's forward under autocast (float16), through ``functional_call``."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.Tanh())
    model.append(nn.Linear(32, 4))
    names = [name for name, _ in model.named_parameters()]

    def micro_batch(x, target):
        def loss(params):
            with torch.autocast("cpu", dtype=torch.float16):
                out = functional_call(model, dict(zip(names, params, strict=True)), (x,))
            return torch.nn.functional.mse_loss(out.float(), target)

        return loss

    initial = [p.detach().clone() for p in model.parameters()]
    return initial, micro_batch


@pytest.mark.parametrize("path", ["default", "fused", "step_in_backward"])
@pytest.mark.parametrize("micro_batches", [1, 8])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_models_autocast_backward_steps_as_torch_optim(name, micro_batches, path):
    """Within the documented rounding of exact float32 training at the first step; after it
    the weights differ, and so do the gradients of the next backward, by more than rounding."""
    initial, micro_batch = mlp_under_autocast()
    kwargs = {"lr": 1e-2, "momentum": 0.9} if name == "SGD" else {"lr": 1e-2}
    trio = Trio(name, kwargs, initial, path=path)
    generator = torch.Generator().manual_seed(1)
    for step in range(3):
        batches = []
        for _ in range(micro_batches):
            x, target = (
                torch.randn(16, 12, generator=generator),
                torch.randn(16, 4, generator=generator),
            )
            batches.append(micro_batch(x, target))
        trio.iteration(batches)
        trio.assert_matches_rounded()
        if step == 0:
            trio.assert_within_rounding_of_exact()


@pytest.mark.parametrize("direction", ["torch_to_mixedopt", "mixedopt_to_torch"])
@given(s=scenarios(), save_after=st.integers(1, 3))
def test_state_dict_round_trip_mid_training_continues_identically(direction, s, save_after):
    s.update(steps=save_after, non_finite=None, loss_scale=None, max_grad_norm=None)
    trio = run_scenario(s)
    source = trio.rounded.opt if direction == "torch_to_mixedopt" else trio.mixed.opt
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)

    def saved():  # a fresh copy each time: load_state_dict may keep the tensors it is given
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    mixed_cls, torch_cls = EVERY_OPTIMIZER[s["name"]]
    trio.mixed.opt.remove_grad_storage()
    trio.mixed.opt = mixed_cls(trio.mixed.params, **s["kwargs"], grad_dtype=s["grad_dtype"])
    trio.rounded.opt = torch_cls(trio.rounded.params, **s["kwargs"])
    trio.mixed.opt.load_state_dict(saved())
    trio.rounded.opt.load_state_dict(saved())
    trio.assert_matches_rounded()

    generator = torch.Generator().manual_seed(s["seed"] + 1)
    for _ in range(2):
        grads = gradient_tensors(s["shapes"], s["magnitudes"], s["spread"], generator)
        trio.iteration([loss_with_gradients(grads)])
        trio.assert_matches_rounded()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_parameters_that_are_not_dense_are_updated_whole_between_slices(name):
    """A strided parameter cannot be cut into flat slices: it is a batch of its own."""
    torch.manual_seed(0)
    values = [torch.randn(5), torch.randn(6, 4), torch.randn(9)]

    def make(i):  # the middle parameter: every other column of a larger tensor
        if i != 1:
            return nn.Parameter(values[i].clone())
        base = torch.zeros(6, 8)
        base[:, ::2] = values[i]
        return nn.Parameter(base[:, ::2])

    params = [make(i) for i in range(3)]
    reference = [make(i) for i in range(3)]
    assert not params[1].is_contiguous()
    mixed_cls, torch_cls = OPTIMIZERS[name]
    opt, ref = mixed_cls(params, lr=0.01), torch_cls(reference, lr=0.01)
    with slice_elements(7):  # the strided parameter (24 elements) is larger than a slice
        for _ in range(3):
            for p, q in zip(params, reference, strict=True):
                g = torch.randn(p.shape) * 1e-3
                (p * g).sum().backward()  # autograd's gradient is g itself
                q.grad = stored_as_documented(g)
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_trio_tolerates_no_more_than_float32_noise():
    """The comparison can fail: a weight 1e-5 off, relatively, is not float32 noise."""
    initial = [torch.randn(4)]
    trio = Trio("SGD", {"lr": 0.1}, initial)
    trio.iteration([loss_with_gradients([torch.ones(4)])])
    with torch.no_grad():
        trio.mixed.params[0].mul_(1 + 1e-5)
    with pytest.raises(AssertionError):
        trio.assert_matches_rounded()

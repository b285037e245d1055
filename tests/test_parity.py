"""Numeric parity with torch.optim, fed the same float32 gradients (hypothesis properties)."""

from __future__ import annotations

import io

import pytest
import torch
from helpers import OPTIMIZERS, Twins, packing, scenarios, slice_elements
from hypothesis import given
from hypothesis import strategies as st
from torch import nn


@given(scenarios())
def test_step_matches_torch_optim_fed_the_same_fp32_gradients(s):
    twins = Twins(s["name"], s["kwargs"], s["shapes"], s["seed"])
    with packing(s["packing"]):
        for step in range(s["steps"]):
            grads = twins.backward(s["magnitudes"][step % len(s["magnitudes"])])
            twins.feed_reference(grads)
            twins.opt.step()
            twins.ref.step()
            twins.assert_equal()
            twins.zero_grad()


@given(scenarios(), st.floats(0.01, 10.0))
def test_max_grad_norm_equals_clip_grad_norm_on_fp32_gradients(s, max_norm):
    twins = Twins(s["name"], s["kwargs"], s["shapes"], s["seed"], max_grad_norm=max_norm)
    for step in range(s["steps"]):
        grads = twins.backward(s["magnitudes"][step % len(s["magnitudes"])] / 3)
        twins.feed_reference(grads)
        total = torch.nn.utils.clip_grad_norm_(twins.ref_params, max_norm)
        with packing(s["packing"]):  # norms of large gradients go slice by slice
            twins.opt.step()
        twins.ref.step()
        torch.testing.assert_close(twins.opt.last_grad_norm, total)
        twins.assert_equal()
        twins.zero_grad()


@given(scenarios(), st.integers(0, 20))
def test_grad_scaler_steps_equal_unscaled_steps(s, scale_exponent):
    twins = Twins(s["name"], s["kwargs"], s["shapes"], s["seed"])
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**scale_exponent, growth_interval=2)
    for step in range(s["steps"]):
        grads = twins.backward(s["magnitudes"][step % len(s["magnitudes"])] / 3, scaler)
        twins.feed_reference(grads)
        scaler.step(twins.opt)
        scaler.update()
        twins.ref.step()
        twins.assert_equal()
        twins.zero_grad()


@pytest.mark.parametrize("direction", ["torch_to_mixedopt", "mixedopt_to_torch"])
@given(s=scenarios(), save_after=st.integers(1, 3))
def test_state_dict_round_trip_mid_training_continues_identically(direction, s, save_after):
    twins = Twins(s["name"], s["kwargs"], s["shapes"], s["seed"])
    for step in range(save_after):
        twins.feed_reference(twins.backward(s["magnitudes"][step % len(s["magnitudes"])]))
        twins.opt.step()
        twins.ref.step()
        twins.zero_grad()

    source = twins.ref if direction == "torch_to_mixedopt" else twins.opt
    buffer = io.BytesIO()
    torch.save(source.state_dict(), buffer)

    def saved():  # a fresh copy each time: load_state_dict may keep the tensors it is given
        buffer.seek(0)
        return torch.load(buffer, weights_only=True)

    mixed_cls, torch_cls = OPTIMIZERS[s["name"]]
    twins.opt.remove_grad_storage()
    twins.opt = mixed_cls(twins.params, **s["kwargs"])
    twins.ref = torch_cls(twins.ref_params, **s["kwargs"])
    twins.opt.load_state_dict(saved())
    twins.ref.load_state_dict(saved())
    twins.assert_equal()

    for step in range(2):
        twins.feed_reference(twins.backward(s["magnitudes"][step % len(s["magnitudes"])]))
        twins.opt.step()
        twins.ref.step()
        twins.assert_equal()
        twins.zero_grad()


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
                g = torch.randn(p.shape)
                (p * g).sum().backward()
                q.grad = opt.true_grad(p)
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    for p, q in zip(params, reference, strict=True):
        torch.testing.assert_close(p, q)

"""Numeric parity with torch.optim, fed the same float32 gradients (hypothesis properties)."""

from __future__ import annotations

import contextlib
import io

import pytest
import torch
from helpers import OPTIMIZERS
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mixedopt
import mixedopt._core

SHAPES = st.lists(
    st.sampled_from([(), (0,), (1,), (5,), (3, 4), (2, 3, 2), (17,), (64,)]), min_size=1, max_size=4
)
LR = st.floats(min_value=1e-4, max_value=0.1)
WEIGHT_DECAY = st.sampled_from([0.0, 1e-2])


@st.composite
def hyperparameters(draw, name):
    foreach = draw(st.sampled_from([None, False, True]))
    maximize = draw(st.booleans())
    if name == "RMSprop":
        return dict(
            lr=draw(LR),
            alpha=draw(st.floats(min_value=0.5, max_value=0.999)),
            eps=draw(st.sampled_from([1e-8, 1e-3])),
            weight_decay=draw(WEIGHT_DECAY),
            momentum=draw(st.sampled_from([0.0, 0.9])),
            centered=draw(st.booleans()),
            foreach=foreach,
            maximize=maximize,
        )
    if name in ("Adam", "AdamW"):
        return dict(
            lr=draw(LR),
            betas=(draw(st.floats(0.5, 0.95)), draw(st.floats(0.9, 0.9999))),
            eps=draw(st.sampled_from([1e-8, 1e-3])),
            weight_decay=draw(WEIGHT_DECAY),
            amsgrad=draw(st.booleans()),
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
        slice_elements=draw(st.sampled_from([1 << 20, 7, 1])),
        seed=draw(st.integers(0, 2**16)),
    )


@contextlib.contextmanager
def slice_elements(n):
    """Make step() cut the gradients into slices of ``n`` elements."""
    saved = mixedopt._core.SLICE_ELEMENTS
    mixedopt._core.SLICE_ELEMENTS = n
    try:
        yield
    finally:
        mixedopt._core.SLICE_ELEMENTS = saved


class Twins:
    """The same parameters under a mixedopt optimizer and under its torch.optim parent."""

    def __init__(self, name, kwargs, shapes, seed, **extra):
        generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        data = [torch.randn(shape, generator=generator) for shape in shapes]
        self.params = [nn.Parameter(d.clone()) for d in data]
        self.ref_params = [nn.Parameter(d.clone()) for d in data]
        mixed_cls, torch_cls = OPTIMIZERS[name]
        self.opt = mixed_cls(self.params, **kwargs, **extra)
        self.ref = torch_cls(self.ref_params, **kwargs)

    def backward(self, magnitude, scaler=None):
        """Store a gradient through autograd; return the float32 gradients it stands for."""
        loss = 0
        for p in self.params:
            g = torch.randn(p.shape, generator=self.generator) * 10.0**magnitude
            loss = loss + (p * g).sum()
        loss_scale = 1.0
        if scaler is not None:
            loss = scaler.scale(loss)
            loss_scale = scaler.get_scale()
        loss.backward()
        return [self.opt.true_grad(p) / loss_scale for p in self.params]

    def feed_reference(self, grads):
        for q, g in zip(self.ref_params, grads, strict=True):
            q.grad = g.clone()

    def zero_grad(self):
        self.opt.zero_grad()
        self.ref.zero_grad()

    def assert_equal(self):
        for p, q in zip(self.params, self.ref_params, strict=True):
            torch.testing.assert_close(p, q)
            mixed_state, ref_state = self.opt.state[p], self.ref.state[q]
            assert mixed_state.keys() == ref_state.keys()
            for key, value in ref_state.items():
                if torch.is_tensor(value):
                    assert mixed_state[key].dtype == value.dtype == torch.float32
                    assert mixed_state[key].shape == value.shape
                torch.testing.assert_close(mixed_state[key], value)


@given(scenarios())
def test_step_matches_torch_optim_fed_the_same_fp32_gradients(s):
    twins = Twins(s["name"], s["kwargs"], s["shapes"], s["seed"])
    with slice_elements(s["slice_elements"]):
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

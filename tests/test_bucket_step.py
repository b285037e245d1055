"""The whole-bucket step (``_bucket_step.py``) against the reference path it stands in for.

The reference is the same optimizer with ``WholeBucketPath.take`` returning nothing: every
gradient then goes through the reference path (``ReferencePath``). Results must be bitwise equal.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import OPTIMIZERS, SHAPES, hyperparameters, params_of
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mixedopt
import mixedopt._budget
from mixedopt._bucket_step import WholeBucketPath

TAKE = WholeBucketPath.take


def whole_buckets_of(opt):
    """The whole buckets the next step of ``opt`` would take."""
    return opt._stages.whole_buckets.take(None, opt.max_grad_norm)[0]


def backward(params, seed, scaler=None, magnitude=0.0):
    generator = torch.Generator().manual_seed(seed)
    loss = sum(
        (p * torch.randn(p.shape, generator=generator) * 10.0**magnitude).sum() for p in params
    )
    (loss if scaler is None else scaler.scale(loss)).backward()


def two_groups(params, kwargs):
    """Every other parameter in a second group with its own lr: buckets span both groups."""
    second = {**kwargs, "lr": kwargs.get("lr", 1e-3) * 0.5}
    groups = [{"params": params[0::2], **kwargs}]
    if params[1::2]:
        groups.append({"params": params[1::2], **second})
    return groups


@contextlib.contextmanager
def counted_whole_buckets(enabled):
    """Count the whole buckets steps take; ``enabled=False``: none (the reference path)."""
    taken = []

    def counting(self, params, max_grad_norm):
        found, left = TAKE(self, params, max_grad_norm) if enabled else ([], None)
        taken.append(len(found))
        return found, left

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(WholeBucketPath, "take", counting)
        yield taken


def train(make, shapes, seed, steps, backwards, whole_buckets, change=None):
    """Weights and states after ``steps``; how many buckets the whole-bucket step took."""
    params = params_of(shapes, seed)
    opt = make(params)
    with counted_whole_buckets(whole_buckets) as taken:
        for step in range(steps):
            for b in range(backwards):
                backward(params, seed + 10 * step + b, magnitude=float(step - b))
            if change is not None:
                change(params)
            opt.step()
            opt.zero_grad()
    return [p.detach().clone() for p in params], [dict(opt.state[p]) for p in params], sum(taken)


def assert_same(first, second):
    (weights, states, _), (ref_weights, ref_states, _) = first, second
    for p, q in zip(weights, ref_weights, strict=True):
        assert torch.equal(p, q)
    for state, ref_state in zip(states, ref_states, strict=True):
        assert state.keys() == ref_state.keys()
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), key


@st.composite
def settings(draw):
    name = draw(st.sampled_from(sorted(OPTIMIZERS)))
    kwargs = draw(hyperparameters(name))
    if name != "RMSprop" and draw(st.booleans()):  # torch's fused update takes the buckets
        kwargs = {**kwargs, "foreach": None, "fused": True}
    return name, kwargs, draw(st.sampled_from([torch.float16, torch.bfloat16]))


@given(
    setting=settings(),
    shapes=SHAPES,
    grouped=st.booleans(),
    capacity=st.sampled_from([1 << 20, 128, 64]),
    small=st.sampled_from([1 << 15, 12]),
    backwards=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_whole_buckets_update_as_the_reference_path_does(
    setting, shapes, grouped, capacity, small, backwards, seed
):
    name, kwargs, grad_dtype = setting

    def make(params):
        groups = two_groups(params, kwargs) if grouped else params
        return OPTIMIZERS[name][0](groups, grad_dtype=grad_dtype, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(mixedopt._budget, "CPU_CAPACITY", capacity)  # one bucket or several
        patch.setattr(mixedopt._budget, "CPU_SMALL", small)  # 12: larger gradients alone
        fast = train(make, shapes, seed, 3, backwards, whole_buckets=True)
        reference = train(make, shapes, seed, 3, backwards, whole_buckets=False)
    assert_same(fast, reference)
    if any(0 < torch.Size(s).numel() <= small for s in shapes):
        assert fast[2] >= 2  # steps 2 and 3: the first one creates the state


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_gradscaler_steps_whole_buckets_as_the_reference_path_does(name):
    results = []
    for whole_buckets in (True, False):
        params = params_of([(3, 4), (5,), (64,)], 0)
        opt = OPTIMIZERS[name][0](params, lr=1e-3)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with counted_whole_buckets(whole_buckets) as taken:
            for step in range(3):
                backward(params, step, scaler)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        results.append(([p.detach() for p in params], [dict(opt.state[p]) for p in params], 0))
        assert (sum(taken) >= 2) if whole_buckets else sum(taken) == 0
    assert_same(*results)


def test_an_inf_written_into_a_stored_bucket_skips_the_step_and_changes_nothing():
    params = params_of([(3, 4), (5,)], 0)
    opt = mixedopt.Adam(params, grad_dtype=torch.bfloat16)
    backward(params, 0)
    opt.step()
    opt.zero_grad()
    weights = [p.detach().clone() for p in params]
    states = [{k: v.clone() for k, v in opt.state[p].items()} for p in params]
    backward(params, 1)
    assert len(whole_buckets_of(opt)) == 1
    params[1].grad.view(-1)[0] = float("inf")  # in place: the storage's bound no longer holds
    assert whole_buckets_of(opt) == []  # so the reference path reads the gradient
    with pytest.warns(RuntimeWarning, match="inf or NaN"):
        opt.step()
    assert opt.skipped_steps == 1
    for p, w, state in zip(params, weights, states, strict=True):
        assert torch.equal(p, w)
        assert all(torch.equal(opt.state[p][k], v) for k, v in state.items())


def test_a_stored_inf_gradient_skips_the_whole_bucket_step():
    params = params_of([(3, 4), (5,)], 0)
    opt = mixedopt.SGD(params, lr=0.1, momentum=0.9)
    backward(params, 0)
    opt.step()
    opt.zero_grad()
    weights = [p.detach().clone() for p in params]
    buffers = [opt.state[p]["momentum_buffer"].clone() for p in params]
    backward(params, 1, magnitude=40.0)  # 1e40 overflows float32: inf as backward stores it
    assert len(whole_buckets_of(opt)) == 1
    with pytest.warns(RuntimeWarning, match="inf or NaN"):
        opt.step()
    assert opt.skipped_steps == 1
    for p, w, b in zip(params, weights, buffers, strict=True):
        assert torch.equal(p, w)
        assert torch.equal(opt.state[p]["momentum_buffer"], b)


class _Ops(TorchDispatchMode):
    """The names of the aten operations dispatched under it."""

    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_a_bfloat16_bucket_is_upcast_without_multiplying_by_its_storage_scales(grad_dtype):
    """bfloat16 stores true values (scale 1): with no loss scale, the upcast is a copy alone."""
    params = params_of([(3, 4), (5,)], 0)
    opt = mixedopt.SGD(params, lr=0.1, momentum=0.9, grad_dtype=grad_dtype)
    backward(params, 0)
    opt.step()  # the reference path: it creates the state
    opt.zero_grad()
    backward(params, 1)
    assert len(whole_buckets_of(opt)) == 1
    with _Ops() as ops:
        opt.step()
    gathers = ("aten.take.default", "aten.index_select.default")  # an accelerator's, the host's
    unscaling = [name for name in ops.names if name in (*gathers, "aten.div_.Tensor")]
    expected = ["aten.index_select.default", "aten.div_.Tensor"]  # a scale per row, divided by
    assert unscaling == ([] if grad_dtype == torch.bfloat16 else expected)


def test_a_bucket_shared_with_another_optimizer_takes_the_reference_path():
    params = params_of([(3, 4), (5,), (2, 3, 2), (17,)], 0)
    first, second = mixedopt.Adam(params[0::2]), mixedopt.SGD(params[1::2], lr=0.1)
    for step in range(2):
        backward(params, step)
        assert whole_buckets_of(first) == whole_buckets_of(second) == []
        first.step()
        second.step()
        first.zero_grad()
        second.zero_grad()


def test_a_bucket_whose_gradients_were_cleared_is_not_taken_while_its_buffer_lives():
    # Its views are gone and every .grad is None, but something else (another thread's step
    # scanning the stored buckets, here a reference kept by hand) holds the 16-bit buffer.
    params = params_of([(3, 4), (5,), (17,)], 0)
    opt = mixedopt.SGD(params, lr=0.1, momentum=0.9)
    for step in range(2):  # the second step's bucket has momentum state: a whole bucket
        backward(params, step)
        opt.step()
    backward(params, 2)
    buffer = params[0].grad._base
    assert buffer is not None and all(p.grad._base is buffer for p in params)
    opt.zero_grad()
    before = [p.detach().clone() for p in params]
    assert whole_buckets_of(opt) == []
    opt.step()
    assert all(torch.equal(p, q) for p, q in zip(params, before, strict=True))


def test_a_gradient_changed_in_place_takes_the_reference_path():
    def halve_one(params):
        params[0].grad.mul_(0.5)

    def make(params):
        return mixedopt.AdamW(params, grad_dtype=torch.bfloat16)

    shapes = [(3, 4), (5,), (64,)]
    fast = train(make, shapes, 0, 3, 1, whole_buckets=True, change=halve_one)
    reference = train(make, shapes, 0, 3, 1, whole_buckets=False, change=halve_one)
    assert fast[2] == 0
    assert_same(fast, reference)


def test_max_grad_norm_takes_the_reference_path():
    params = params_of([(3, 4), (5,)], 0)
    opt = mixedopt.Adam(params, max_grad_norm=1.0)
    for step in range(2):
        backward(params, step)
        assert whole_buckets_of(opt) == []
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_step_in_backward_takes_whole_buckets_as_the_reference_path_does(name):
    results = []
    for whole_buckets in (True, False):
        params = params_of([(3, 4), (5,), (64,), (17,)], 0)
        opt = OPTIMIZERS[name][0](params, lr=1e-3)
        with pytest.MonkeyPatch.context() as patch, counted_whole_buckets(whole_buckets) as taken:
            patch.setattr(mixedopt._budget, "CPU_CAPACITY", 128)  # buckets of a few gradients
            patch.setattr(mixedopt._budget, "CPU_SMALL", 16)  # (64,) and (17,) stored alone
            for step in range(3):
                with opt.step_in_backward():
                    backward(params, step)
        results.append(([p.detach() for p in params], [dict(opt.state[p]) for p in params], 0))
        assert (sum(taken) >= 2) if whole_buckets else sum(taken) == 0
    assert_same(*results)

"""Backward's buckets: the fast path against storing each gradient alone, its edge cases, memory."""

from __future__ import annotations

import os

import pytest
import torch
from helpers import OPTIMIZERS, SHAPES, assert_close_to_float32_noise, params_of, peak_in_child
from helpers import backward_of_magnitudes as backward
from hypothesis import example, given
from hypothesis import strategies as st
from parity import stored_as_documented

import mixedopt
import mixedopt._budget
import mixedopt._default_step
import mixedopt._rows
from mixedopt._bucket_step import WholeBucketPath


@given(
    shapes=SHAPES,
    magnitudes=st.lists(st.floats(-9, 6), min_size=4, max_size=4),
    backwards=st.integers(1, 3),
    capacity=st.sampled_from([1 << 20, 128, 64]),
    seed=st.integers(0, 2**16),
)
def test_buckets_store_what_storing_each_gradient_alone_stores(
    shapes, magnitudes, backwards, capacity, seed
):
    """Bitwise: the same 16-bit values and the same scales, accumulation included."""
    bucketed, alone = params_of(shapes, seed), params_of(shapes, seed)
    opt = mixedopt.SGD(bucketed, lr=0.1)
    reference = mixedopt.SGD(alone, lr=0.1)
    saved = mixedopt._budget.CPU_CAPACITY, mixedopt._budget.CPU_SMALL
    try:
        # Buckets are set up at their first backward: each optimizer gets its own sizes.
        mixedopt._budget.CPU_CAPACITY, mixedopt._budget.CPU_SMALL = capacity, capacity
        for i in range(backwards):
            backward(bucketed, [magnitudes[(i + j) % 4] for j in range(len(shapes))], seed + i)
        mixedopt._budget.CPU_SMALL = -1  # every gradient is stored alone
        for i in range(backwards):
            backward(alone, [magnitudes[(i + j) % 4] for j in range(len(shapes))], seed + i)
    finally:
        mixedopt._budget.CPU_CAPACITY, mixedopt._budget.CPU_SMALL = saved
    for p, q in zip(bucketed, alone, strict=True):
        assert p.grad.dtype == q.grad.dtype == torch.float16
        assert p.grad.stride() == q.grad.stride()
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(opt.true_grad(p), reference.true_grad(q))


def test_a_bucket_stored_after_a_large_gradient_stores_what_storing_each_alone_stores(
    monkeypatch,
):
    """A large gradient is scaled through the staging buffer: the next bucket zeroes it first."""
    monkeypatch.setattr(mixedopt._budget, "CPU_CAPACITY", 128)
    monkeypatch.setattr(mixedopt._budget, "CPU_SMALL", 64)
    shapes = [(3,), (300,), (5,)]  # autograd reaches (5,) first, then (300,), stored alone
    bucketed, alone = params_of(shapes, 0), params_of(shapes, 0)
    opt = mixedopt.SGD(bucketed, lr=0.1)
    for i in range(2):
        backward(bucketed, [-3, 3, -3], i)  # the large gradient's values dwarf the others
    monkeypatch.setattr(mixedopt._budget, "CPU_SMALL", -1)  # every gradient is stored alone
    reference = mixedopt.SGD(alone, lr=0.1)
    for i in range(2):
        backward(alone, [-3, 3, -3], i)
    for p, q in zip(bucketed, alone, strict=True):
        assert torch.equal(p.grad, q.grad)
        assert torch.equal(opt.true_grad(p), reference.true_grad(q))


def test_gradients_are_stored_when_backward_returns():
    params = params_of([(3, 4), (5,)], 0)
    opt = mixedopt.Adam(params)
    backward(params, [0, -3], 0)
    assert all(p.grad.dtype == torch.float16 for p in params)
    assert all(opt.true_grad(p) is not None for p in params)


def test_a_bucket_that_fills_is_stored_during_backward(monkeypatch):
    monkeypatch.setattr(mixedopt._budget, "CPU_CAPACITY", 128)
    params = params_of([(64,)] * 5, 0)
    opt = mixedopt.Adam(params)
    seen = []
    # Autograd reaches the last parameter first; by then two buckets of two are stored.
    params[0].register_post_accumulate_grad_hook(lambda p: seen.append([q.grad for q in params]))
    backward(params, [0] * 5, 0)
    stored = [g is not None and g.dtype == torch.float16 for g in seen[0]]
    assert sum(stored) >= 2
    for p in params:
        assert p.grad.dtype == torch.float16
        assert opt.true_grad(p) is not None


def failing_backward(params):
    """A backward that raises after autograd handed over the first parameter's gradient."""
    first, second = params

    def fail(grad):
        raise RuntimeError("raised on purpose")

    middle = second * 2
    middle.register_hook(fail)
    with pytest.raises(RuntimeError, match="raised on purpose"):
        ((first * 3).sum() * middle.sum()).backward()


def test_after_a_backward_that_raises_p_grad_holds_the_true_gradient_and_step_uses_it():
    params = params_of([(4,), (4,)], 0)
    reference = params_of([(4,), (4,)], 0)
    initial = [p.detach().clone() for p in params]
    opt = mixedopt.SGD(params, lr=0.1)
    failing_backward(params)
    failing_backward(reference)
    assert params[0].grad.dtype == torch.float32  # what torch.optim's parameter holds
    assert_close_to_float32_noise(params[0].grad, reference[0].grad)
    assert params[1].grad is None and reference[1].grad is None
    opt.step()  # stores it in float16 first
    stored = opt.true_grad(params[0])
    assert_close_to_float32_noise(stored, stored_as_documented(reference[0].grad))
    assert_close_to_float32_noise(params[0].detach(), initial[0] - 0.1 * stored)
    assert torch.equal(params[1].detach(), initial[1])


def test_zero_grad_after_a_backward_that_raises_drops_what_it_left():
    params = params_of([(4,), (4,)], 0)
    opt = mixedopt.SGD(params, lr=0.1)
    failing_backward(params)
    opt.zero_grad()
    backward(params, [0, 0], 1)
    exact = params_of([(4,), (4,)], 0)
    backward(exact, [0, 0], 1)
    for p, q in zip(params, exact, strict=True):
        assert_close_to_float32_noise(opt.true_grad(p), stored_as_documented(q.grad))


def test_a_backward_after_one_that_raised_reaching_other_parameters_steps_with_both():
    """What the failed backward left and what the next one brought are both stored and used."""
    params = params_of([(4,), (4,), (4,)], 0)
    reference = params_of([(4,), (4,), (4,)], 0)
    initial = [p.detach().clone() for p in params]
    opt = mixedopt.SGD(params, lr=0.1)
    failing_backward(params[:2])
    failing_backward(reference[:2])
    backward(params[2:], [-3], 1)  # reaches none of the parameters left waiting
    backward(reference[2:], [-3], 1)
    stored = [opt.true_grad(p) for p in params]  # stores what waits first
    opt.step()
    assert params[1].grad is None and reference[1].grad is None
    for p, q, before, grad in zip(params, reference, initial, stored, strict=True):
        if q.grad is None:
            assert torch.equal(p.detach(), before)
            continue
        assert p.grad.dtype == torch.float16
        assert_close_to_float32_noise(grad, stored_as_documented(q.grad))
        assert_close_to_float32_noise(p.detach(), before - 0.1 * grad)


MiB = 1 << 20
COUNT, NUMEL = 512, 1 << 15  # 16 Mi elements in gradients of 32Ki elements: 16 buckets

# The peak resident memory of one backward over parameters whose gradients are all bucketed,
# measured as tests/test_memory.py measures a step.
MEASURE = """
library, count, numel = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(count)]
if library == "mixedopt":
    opt = mixedopt.SGD(params, lr=0.1)
weights = [torch.randn(numel) for _ in range(count)]

def backward():
    loss = sum((p * w).sum() for p, w in zip(params, weights))
    loss.backward()

backward()  # buffers of the first backward (staging) exist
for p in params:
    p.grad = None
reset_peak()
before = status("VmRSS")
backward()
print(json.dumps({"extra": status("VmHWM") - before}))
"""


def backward_peak(library):
    return peak_in_child(MEASURE, library, COUNT, NUMEL)


@pytest.mark.slow  # peaks measured in child processes
@pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs"
)
def test_backward_holds_16_bit_gradients_and_a_bounded_float32_transient():
    """docs/grad.md's bound: 16-bit gradients, plus 3 x capacity float32 elements (12 MiB)."""
    elements = COUNT * NUMEL
    assert backward_peak("torch") >= 3.5 * elements  # the measurement sees float32 gradients
    assert backward_peak("mixedopt") <= 2 * elements + 3 * 4 * mixedopt._budget.CPU_CAPACITY


@given(
    kinds=st.lists(
        st.sampled_from([(4, 6), (6,), (2, 3, 2), (0, 3), (1,)]), min_size=1, max_size=9
    ),
    gaps=st.lists(st.integers(0, 3), min_size=9, max_size=9),
    transposed=st.booleans(),
)
# A weight and a bias per layer: each run's positions evenly spaced (put in place by a slice).
@example(kinds=[(4, 6), (6,)] * 4, gaps=[0] * 9, transposed=False)
def test_views_made_per_run_are_those_made_one_by_one(kinds, gaps, transposed):
    """``ViewRuns`` (stacked views, unbound) against one ``as_strided`` per tensor."""
    shapes = [torch.Size(k) for k in kinds]
    strides = [
        tuple(reversed(torch.empty(tuple(reversed(s))).stride()))
        if transposed and len(s) == 2
        else torch.empty(s).stride()
        for s in shapes
    ]
    offsets, at = [], 3
    for shape, gap in zip(shapes, gaps, strict=False):
        offsets.append(at)
        at += shape.numel() + gap  # uneven spacing splits runs
    buffer = torch.arange(at + 8, dtype=torch.float16)[2:]  # a buffer with an offset of its own
    runs = mixedopt._rows.ViewRuns(shapes, strides, offsets)
    for view, shape, stride, offset in zip(
        runs.views(buffer), shapes, strides, offsets, strict=True
    ):
        expected = buffer.as_strided(shape, stride, buffer.storage_offset() + offset)
        assert (view.shape, view.stride()) == (expected.shape, expected.stride())
        assert view.storage_offset() == expected.storage_offset()
        assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()


def train_twice(name, kwargs, shapes, seed, steps, backwards):
    """Weights and state after ``steps`` of one optimizer that upcasts whole buckets straight
    from their 16-bit rows and of one that takes every gradient in batches (the reference);
    and how many buckets took the first way.
    """
    results, whole_buckets = [], []
    real = mixedopt._default_step._whole_buckets
    for straight in (True, False):
        counted = []

        def counting(entries, stored_bucket, device, straight=straight, counted=counted):
            whole, rest = real(entries, stored_bucket, device)
            if not straight:
                return [], list(range(len(entries)))
            counted.append(len(whole))
            return whole, rest

        params = params_of(shapes, seed)
        opt = OPTIMIZERS[name][0](params, **kwargs)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(mixedopt._default_step, "_whole_buckets", counting)
            # The whole-bucket step (tests/test_bucket_step.py) would take them first.
            patch.setattr(WholeBucketPath, "take", lambda *_: ([], None))
            for step in range(steps):
                for b in range(backwards):
                    backward(params, [float(step - b)] * len(params), seed + step + b)
                opt.step()
                opt.zero_grad()
        results.append(([p.detach() for p in params], [dict(opt.state[p]) for p in params]))
        whole_buckets.append(sum(counted))
    return results, whole_buckets[0]


@given(
    name=st.sampled_from(sorted(OPTIMIZERS)),
    shapes=SHAPES,
    backwards=st.integers(1, 2),
    seed=st.integers(0, 2**16),
)
def test_buckets_upcast_from_their_rows_update_as_batches_do(name, shapes, backwards, seed):
    kwargs = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    (fast, reference), whole = train_twice(name, kwargs, shapes, seed, 3, backwards)
    assert whole >= 2  # steps 2 and 3 (the first creates the state on the reference path)
    (weights, states), (ref_weights, ref_states) = fast, reference
    for p, q in zip(weights, ref_weights, strict=True):
        assert torch.equal(p, q)
    for state, ref_state in zip(states, ref_states, strict=True):
        for key, value in ref_state.items():
            assert torch.equal(state[key], value), key

"""The accelerator path run on the CPU: an accelerator's budget given to the CPU.

What an accelerator changes (``_budget.Budget.on_host`` false): a gradient stored alone finds
its scale with tensor operations (four launches), a bucket is rounded into 16 bits with one
multiplication, the default step takes batches of up to ``piece`` elements (64 Mi on a GPU:
whole buckets joined, parameters cut only when larger), keeps no buffer larger than a bucket
between steps, and ``fused=True`` decides the skip on the device. The launches themselves are
counted in ``test_launches.py``; parity with torch.optim on this path in ``test_parity.py``,
whose scenarios draw accelerators' budgets too.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import pytest
import torch
from helpers import OPTIMIZERS, SHAPES, assert_close_to_float32_noise, params_of, setting
from helpers import backward_of_magnitudes as backward
from hypothesis import given
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

import mixedopt
import mixedopt._budget
import mixedopt._compiled
from mixedopt._budget import accelerator_budget


def on_accelerator(capacity=4096, small=1024, batch=1 << 20):
    """The CPU with an accelerator's budget: gradients of more than ``small`` stored alone."""
    return setting(
        mixedopt._budget, "CPU_BUDGET", accelerator_budget(capacity, small, small, batch)
    )


class HostReads(TorchDispatchMode):
    """Counts the values read on the host (``.item()``, ``bool()``)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@given(
    shapes=SHAPES,
    magnitudes=st.lists(st.floats(-9, 6), min_size=4, max_size=4),
    backwards=st.integers(1, 3),
    seed=st.integers(0, 2**16),
)
def test_buckets_and_gradients_alone_store_what_the_cpu_path_stores(
    shapes, magnitudes, backwards, seed
):
    """Bitwise: the same 16-bit values and scales, accumulation included."""
    stored = []
    # The CPU's own path, then an accelerator's with buckets, and with every gradient alone.
    for budget in (contextlib.nullcontext(), on_accelerator(), on_accelerator(small=-1)):
        params = params_of(shapes, seed)
        opt = mixedopt.SGD(params, lr=0.1)
        with budget:
            for i in range(backwards):
                backward(params, [magnitudes[(i + j) % 4] for j in range(len(shapes))], seed + i)
        stored.append([(p.grad, opt.true_grad(p)) for p in params])
    for (grad, true), *others in zip(*stored, strict=True):
        for other_grad, other_true in others:
            assert grad.dtype == other_grad.dtype == torch.float16
            assert torch.equal(grad, other_grad)
            assert torch.equal(true, other_true)


def updates(opt):
    """Record the sizes of the parameters of each call of the functional update."""
    found = []
    update = opt._update

    def recording(group, params, *args, **kwargs):
        found.append([p.numel() for p in params])
        return update(group, params, *args, **kwargs)

    opt._update = recording
    return found


def test_the_default_step_takes_parameters_whole_and_cuts_only_those_larger_than_a_batch():
    params = params_of([(3000,)] * 5 + [(25000,)])  # each larger than a bucket takes
    opt = mixedopt.Adam(params)
    with on_accelerator(batch=10_000):
        backward(params, [0] * 6, 0)
        opt.step()  # creates the state
        opt.zero_grad()
        backward(params, [0] * 6, 1)
        found = updates(opt)
        opt.step()
    assert found == [[3000, 3000, 3000], [3000, 3000], [10_000], [10_000], [5000]]


def test_the_default_step_joins_whole_buckets_into_batches():
    """40 gradients of 500 elements: five buckets of eight (4096 elements), joined by two."""
    params = params_of([(500,)] * 40)
    opt = mixedopt.Adam(params)
    with on_accelerator(batch=10_000):
        backward(params, [0] * 40, 0)
        opt.step()
        opt.zero_grad()
        backward(params, [0] * 40, 1)
        found = updates(opt)
        opt.step()
    assert [len(sizes) for sizes in found] == [16, 16, 8]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_joined_batches_give_the_weights_of_one_batch_per_bucket(name):
    """Bitwise: how buckets are batched changes no number."""
    weights = []
    for batch in (4096, 1 << 20):  # one bucket a batch; all buckets in one
        params = params_of([(500,)] * 40 + [(64, 64)])
        opt = OPTIMIZERS[name][0](params, lr=1e-3)
        with on_accelerator(batch=batch):
            for i in range(3):
                backward(params, [i - 3] * 41, i)
                opt.step()
                opt.zero_grad()
        weights.append([p.detach().clone() for p in params])
    for mine, theirs in zip(*weights, strict=True):
        assert torch.equal(mine, theirs)


def test_the_step_keeps_no_buffer_larger_than_a_bucket_and_none_between_steps():
    """A batch of the default step is taken from the allocator and given back after it; the
    buffer of a bucket's size the step's batches share goes back when the step ends."""
    params = params_of([(3000,)] * 5 + [(10,)] * 3)
    opt = mixedopt.RMSprop(params)
    workspace = opt._workspace
    kept_until_the_end = []
    release = workspace.release

    def recorded_release():
        kept_until_the_end.append([buffer.numel() for buffer in workspace._buffers.values()])
        release()

    workspace.release = recorded_release
    with on_accelerator(batch=10_000):  # the large gradients in batches of 9000 and 6000
        for i in range(3):
            backward(params, [0] * 8, i)
            opt.step()
            opt.zero_grad()
    assert kept_until_the_end[-1] == [3 * 64]  # the small gradients' bucket
    assert not workspace._buffers


def test_a_step_of_the_default_path_reads_one_value_on_the_host():
    """Whether a gradient is inf or NaN, to skip the step (SGD: torch reads no step counter)."""
    params = params_of([(3000,)] * 3 + [(10,)] * 3)
    opt = mixedopt.SGD(params, lr=0.1, momentum=0.9)
    with on_accelerator():
        for i in range(3):
            backward(params, [0] * 6, i)
            with HostReads() as reads:
                opt.step()
            opt.zero_grad()
    assert reads.count == 1


@pytest.fixture
def eager_kernels(monkeypatch):
    """The fused kernels run uncompiled (the same arithmetic; a dispatch mode can see inside),
    and each compiled call is recorded."""
    calls = []
    run = mixedopt._compiled._run

    def recording(kernel, arguments):
        calls.append(kernel.__name__)
        return run(kernel, arguments)

    monkeypatch.setattr(mixedopt._compiled, "compiled", lambda kernel: kernel)
    monkeypatch.setattr(mixedopt._compiled, "_run", recording)
    return calls


def fused_steps(name, params, steps, inf_at=None):
    opt = OPTIMIZERS[name][0](params, lr=1e-3, fused=True)
    for i in range(steps):
        backward(params, [math.inf if i == inf_at else -2] * len(params), i)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a skipped step's warning
            opt.step()
        opt.zero_grad()
    return opt


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_fused_step_reads_nothing_on_the_host(name, eager_kernels):
    params = params_of([(3000,)] * 3 + [(10,)] * 3)
    with on_accelerator():
        opt = fused_steps(name, params, 2)  # the first step creates the state
        backward(params, [0] * 6, 2)
        with HostReads() as reads:
            opt.step()
    assert reads.count == 0


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_fused_step_makes_one_compiled_call_per_eight_large_parameters(name, eager_kernels):
    """Parameters above ``fused_small`` (1024 here): ceil(20 / 8) = 3 calls, whatever their
    number of elements; the small ones take torch's fused update (RMSprop: one pack)."""
    params = params_of([(3000,)] * 20 + [(10,)] * 3)
    with on_accelerator():
        opt = fused_steps(name, params, 1)  # the first step creates the state
        eager_kernels.clear()
        backward(params, [0] * 23, 1)
        opt.step()
    packs = 1 if name == "RMSprop" else 0
    assert len(eager_kernels) == 3 + packs


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_steps_decide_the_skip_on_the_device_and_give_the_default_paths_weights(
    name, eager_kernels
):
    fused_params, default_params = (
        params_of([(3000,)] * 3 + [(10,)] * 3),
        params_of([(3000,)] * 3 + [(10,)] * 3),
    )
    with on_accelerator():
        fused = fused_steps(name, fused_params, 5, inf_at=3)
        cls = OPTIMIZERS[name][0]
        default = cls(default_params, lr=1e-3)
        for i in range(5):
            backward(default_params, [math.inf if i == 3 else -2] * 6, i)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", RuntimeWarning)
                default.step()
            default.zero_grad()
    assert fused.skipped_steps == default.skipped_steps == 1
    for p, q in zip(fused_params, default_params, strict=True):
        assert_close_to_float32_noise(p, q)
        for key, value in default.state[q].items():
            assert_close_to_float32_noise(fused.state[p][key].to(value.device), value)

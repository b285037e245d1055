"""Medium tensors (100K-1M elements): gradients stored alone, bit for bit, in torch's layout.

The MLP 256-512-512-512-10 of ``mixedopt.bench.medium`` under ``torch.autocast(float16)``: its
three large weights' gradients are stored alone (above the bucket limit), its small weight and
biases in a bucket. Each stored gradient holds exactly the float32 gradient times its storage
scale rounded once, with the strides torch's ``AccumulateGrad`` gives ``.grad``, whatever the
memory order the gradient arrives in.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

import mixedopt
from mixedopt.bench import medium


def backward(model: nn.Module, seed: int = 0) -> None:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(medium.BATCH, medium.WIDTHS[0], generator=generator)
    y = torch.randint(0, medium.WIDTHS[-1], (medium.BATCH,), generator=generator)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()


def test_the_mlp_has_the_sizes_of_the_regime():
    model = medium.model()
    sizes = [p.numel() for p in model.parameters()]
    assert len(sizes) == 8 and sum(sizes) == 662_026
    small = mixedopt._budget.budget(torch.device("cpu")).bucket_small
    assert [n for n in sizes if n > small] == [131_072, 262_144, 262_144]


@pytest.mark.parametrize("accumulate", [False, True])
def test_each_gradient_is_the_float32_one_scaled_and_rounded_once_in_torchs_layout(accumulate):
    """torch.optim's float32 gradients are the reference: mixedopt's computation is the same,
    so its stored gradients are theirs times the storage scale, rounded once, bit for bit."""
    model = medium.model()
    reference = copy.deepcopy(model)
    opt = mixedopt.AdamW(model.parameters())
    torch.optim.AdamW(reference.parameters(), foreach=True)
    for seed in range(1 + accumulate):
        backward(model, seed)
        backward(reference, seed)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.grad.dtype == torch.float16
        assert p.grad.stride() == q.grad.stride() == p.stride()
        if accumulate:  # the sum is taken in float32 from the first stored gradient
            torch.testing.assert_close(opt.true_grad(p), q.grad, rtol=2.0**-10, atol=0)
            continue
        scale = opt._grad_storage.scale_of(p)
        assert math.frexp(scale.item())[0] == 0.5  # a power of two
        assert torch.equal(p.grad, (q.grad * scale).half())
        assert 2**7 <= p.grad.float().abs().max() < 2**8


class _Transposed(torch.autograd.Function):
    """The identity, whose gradient comes back in the transposed memory order."""

    @staticmethod
    def forward(ctx, w):  # noqa: ANN001, ANN205
        return w.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205
        return grad.t().contiguous().t()


@pytest.mark.parametrize("shape", [(512, 512), (384, 200)])
def test_a_gradient_in_another_memory_order_is_stored_in_the_parameters(shape):
    """Stored alone, a gradient that arrives transposed gets the parameter's strides, as torch's
    ``AccumulateGrad`` gives it, and the same bits."""
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=generator) * 1e-5
    g = torch.randn(shape, generator=generator)
    p, q = nn.Parameter(w.clone()), nn.Parameter(w.clone())
    opt = mixedopt.SGD([p], lr=0.1)
    for param in (p, q):
        (_Transposed.apply(param) * g).sum().backward()
    assert p.grad.numel() > mixedopt._budget.budget(p.device).bucket_small  # stored alone
    assert p.grad.stride() == q.grad.stride() == p.stride()
    scale = opt._grad_storage.scale_of(p)
    assert torch.equal(p.grad, (q.grad * scale).half())


def test_the_regime_times_fwd_bwd_step_and_iteration_of_each_library():
    text, figures = medium.report(repeat=2, pairs=["AdamW, default vs foreach"])
    found = figures["iteration_ms"]["AdamW, default vs foreach"]
    for library in ("torch", "mixedopt"):
        assert all(found[library][part] > 0 for part in medium.PARTS)
        assert found[library]["page faults"] >= 0  # Linux counts them
        assert found[library]["iteration"] >= found[library]["fwd+bwd"]
    assert text.count("\n| AdamW") == 1  # a row for the pair timed
    assert "| AdamW, default vs foreach |" in text


@pytest.mark.slow  # the fused step compiles for seconds
def test_the_regime_compares_the_fused_steps_too():
    _, figures = medium.report(repeat=2)
    assert set(figures["iteration_ms"]) == set(medium.PAIRS)

"""What a GPU pays for a large parameter: the bytes its kernels read and write.

Counted by ``mixedopt.bench.bytes`` (the launch counter of ``mixedopt.bench.launches`` adding up
the bytes each launch reads and writes): one AdamW iteration of 16 x ``Linear(4096, 4096)``, 512
tokens, on meta parameters (the accelerator path), and of 8 x ``Linear(512, 512)``, 64 tokens,
on CPU tensors under autocast(float16) (the autocast path), mixedopt against torch.optim with
``foreach=True``. Counts, so the bounds are exact: each is today's value or the issue's target
(#40), and says which.
"""

from __future__ import annotations

import pytest
import torch
from helpers import setting, sgd_with_a_pass_more

import mixedopt
import mixedopt._budget
import mixedopt._compiled
from mixedopt.bench.bytes import (
    ACCELERATOR,
    AUTOCAST,
    CASES,
    H200,
    ROOFLINE_REGIMES,
    ByteCounter,
    Iteration,
    Part,
    bytes_table,
    count_iteration,
    mixedopt_adamw,
    torch_adamw,
)

# What a bound allows per parameter tensor beyond its bytes per element: the storage scales,
# statistics and lookup tables, whose size is the number of tensors, not of elements (today
# about 2 KiB per tensor in backward, 60 bytes in step()).
PER_TENSOR_BYTES = 4096

# Bytes per parameter of a default step() beyond torch.optim's foreach step. The bound
# (#40, point 3), which holds today with 14.25: the copy of the 16-bit gradients into float32
# (2 read, 4 written), their unscaling multiplication (4 + 4) and its factor per 64 elements.
STEP_EXTRA_BYTES_PER_PARAM = 14.5
# Bytes per parameter of forward and backward beyond torch.optim's on the accelerator path.
# Today's: storing a float32 gradient in 16 bits reads it for its largest magnitude (4) and
# again to write it scaled (4 + 2). The target (#40, point 1) is 6.0, one pass: tighten
# this constant to it when that lands.
FWD_BWD_EXTRA_BYTES_PER_PARAM = 10.0
# The same for gradients of at most 1Mi elements, which backward stores in buckets on an
# accelerator: today's, a no-regression bound (the copy into the bucket, 4 + 4, a norm per row,
# 4, the scaled rounding, 4 + 2, and a factor per 64 elements). The issue sets no target.
BUCKETED_FWD_BWD_EXTRA_BYTES_PER_PARAM = 18.375
# The same under torch.autocast, on the CPU: today's, a no-regression bound. The CPU's branch
# reads a float32 gradient nothing else holds for its largest magnitude (4), scales it where it
# is (4 + 4) and rounds it into 16 bits (4 + 2). A multiplication straight into 16 bits counts
# 4 + 2 but writes and reads a float32 temporary of the gradient's size inside the operation
# (the CPU computes in float32 first): the same bytes, in memory no cache holds.
TORCH_AUTOCAST_FWD_BWD_EXTRA_BYTES_PER_PARAM = 18.0
# Forward and backward under mixedopt.autocast beyond torch.optim's under torch.autocast: the
# issue's target (#40, point 2), which holds with -0.75. Each weight's float16 gradient is stored
# as it is, unread, where torch's cast to float32 moves 6; each is cast again for backward (6),
# but the first layer's (its input needs no gradient, so its product saves no cast of it).
MIXEDOPT_AUTOCAST_FWD_BWD_EXTRA_BYTES_PER_PARAM = 0.0
# The default step under mixedopt.autocast beyond torch.optim's foreach step: today's, 8.0. The
# copy of the float16 gradients into float32 (2 read, 4 written) and the read of each for inf and
# NaN (2), which backward no longer makes; their factors are exactly 1, so no multiplication.
MIXEDOPT_AUTOCAST_STEP_EXTRA_BYTES_PER_PARAM = 8.0


@pytest.fixture(scope="module")
def counted():
    return {(case.path, case.forward, case.library): c for case, c in bytes_table(CASES)}


def tensors(regime):
    return regime.layers * (2 if regime.bias else 1)


def assert_beyond_torch_at_most(ours: Part, theirs: Part, c: Iteration, per_param, regime):
    extra = ours.bytes - theirs.bytes
    allowed = per_param * c.params + PER_TENSOR_BYTES * tensors(regime)
    assert extra <= allowed, f"{extra / c.params:.4f} bytes per parameter beyond torch.optim"


@pytest.mark.parametrize(
    ("path", "forward", "regime"),
    [("accelerator", "float32", ACCELERATOR), ("autocast", "torch.autocast", AUTOCAST)],
)
def test_the_default_step_moves_at_most_14_5_bytes_per_parameter_beyond_torch_foreach(
    counted, path, forward, regime
):
    ours, theirs = counted[path, forward, "mixedopt"], counted[path, forward, "torch.optim"]
    bound = STEP_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(ours.step, theirs.step, ours, bound, regime)


def test_forward_and_backward_move_at_most_10_bytes_per_parameter_beyond_torch_on_accelerators(
    counted,
):
    ours = counted["accelerator", "float32", "mixedopt"]
    theirs = counted["accelerator", "float32", "torch.optim"]
    bound = FWD_BWD_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(
        ours.forward_backward, theirs.forward_backward, ours, bound, ACCELERATOR
    )


def test_bucketed_gradients_move_no_more_bytes_than_today_on_accelerators():
    regime = ROOFLINE_REGIMES[1]  # 32 x Linear(1024, 1024), 2048 tokens
    ours = count_iteration(mixedopt_adamw, regime)
    theirs = count_iteration(torch_adamw, regime)
    bound = BUCKETED_FWD_BWD_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(ours.forward_backward, theirs.forward_backward, ours, bound, regime)


def test_forward_and_backward_under_torch_autocast_move_no_more_bytes_than_today(counted):
    ours = counted["autocast", "torch.autocast", "mixedopt"]
    theirs = counted["autocast", "torch.autocast", "torch.optim"]
    bound = TORCH_AUTOCAST_FWD_BWD_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(
        ours.forward_backward, theirs.forward_backward, ours, bound, AUTOCAST
    )


def test_forward_and_backward_under_mixedopt_autocast_move_no_more_bytes_than_torch_autocast(
    counted,
):
    ours = counted["autocast", "mixedopt.autocast", "mixedopt"]
    theirs = counted["autocast", "torch.autocast", "torch.optim"]
    bound = MIXEDOPT_AUTOCAST_FWD_BWD_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(
        ours.forward_backward, theirs.forward_backward, ours, bound, AUTOCAST
    )


def test_the_default_step_multiplies_no_gradient_stored_as_it_is_under_mixedopt_autocast(counted):
    ours = counted["autocast", "mixedopt.autocast", "mixedopt"]
    theirs = counted["autocast", "torch.autocast", "torch.optim"]
    bound = MIXEDOPT_AUTOCAST_STEP_EXTRA_BYTES_PER_PARAM
    assert_beyond_torch_at_most(ours.step, theirs.step, ours, bound, AUTOCAST)


def test_the_regimes_count_the_flops_of_their_matrix_products(counted):
    """Forward 2, backward 4 flops per weight element and token, but the first layer's input
    gradient (its input needs none)."""
    for path, forward, regime in [
        ("accelerator", "float32", ACCELERATOR),
        ("autocast", "torch.autocast", AUTOCAST),
    ]:
        c = counted[path, forward, "torch.optim"]
        products = 3 * regime.layers - 1
        assert c.total.flops == products * 2 * regime.width**2 * regime.tokens


@pytest.mark.parametrize("name", ["AdamW", "SGD", "RMSprop"])
def test_a_fused_step_reads_each_16_bit_gradient_once_on_the_accelerator_path(name, monkeypatch):
    """Large parameters (those of the compiled calls), on the CPU given an accelerator's budget
    (meta has no ``fused=True``). The step's operations are counted, and each compiled call as
    the one kernel it is, reading each of its arguments once (the call is recorded, not run):
    the gradients are read there, once, and nothing else passes over the elements."""
    kernel_reads = []

    def recorded(kernel, arguments):
        leaves = torch.utils._pytree.tree_leaves(arguments)
        kernel_reads.extend(t for t in leaves if isinstance(t, torch.Tensor))
        return True

    monkeypatch.setattr(mixedopt._compiled, "_run", recorded)
    budget = mixedopt._budget.accelerator_budget(4096, 1024, 1024, 1 << 20)
    make = {
        "AdamW": lambda p: mixedopt.AdamW(p, fused=True),
        "SGD": lambda p: mixedopt.SGD(p, lr=0.1, momentum=0.9, fused=True),
        "RMSprop": lambda p: mixedopt.RMSprop(p, fused=True),
    }[name]
    torch.manual_seed(0)
    layers = 8  # weights of 4096 elements, above the budget's 1024 packed with others
    model = torch.nn.Sequential(*[torch.nn.Linear(64, 64, bias=False) for _ in range(layers)])
    x = torch.randn(16, 64)
    with setting(mixedopt._budget, "CPU_BUDGET", budget):
        optimizer = make(model.parameters())
        for _ in range(3):  # the first steps create the state
            model(x).square().mean().backward()
            kernel_reads.clear()
            with ByteCounter(cpu=True) as step:
                optimizer.step()
            optimizer.zero_grad()
    gradients = sum(2 * p.numel() for p in model.parameters())
    in_kernels = sum(t.nbytes for t in kernel_reads if t.dtype == torch.float16)
    assert in_kernels == gradients
    assert step.read_by_dtype[torch.float16] == 0
    assert step.bytes <= PER_TENSOR_BYTES * layers


def test_the_byte_count_follows_its_rule():
    """Inputs read, outputs written; in-place: self read and written (copy_: written only);
    out=: written only; a broadcast dimension once; views and allocations nothing."""
    a, b = torch.empty(4, 4, device="meta"), torch.empty(4, 4, device="meta")
    half = torch.empty(4, 4, device="meta", dtype=torch.float16)
    scalar = torch.empty((), device="meta")
    expected = 0
    with ByteCounter() as counter:
        torch.add(a, b)  # 64 + 64 read, 64 written
        expected += 192
        a.mul_(b)  # a read and written, b read
        expected += 192
        torch.mul(a, b, out=half)  # 128 read, 32 written
        expected += 160
        a.copy_(half)  # 32 read, 64 written
        expected += 96
        torch._foreach_mul_([a, b], scalar)  # the list read and written, the scalar read
        expected += 256 + 4
        a.add_(scalar.expand(4, 4))  # the expanded scalar is 4 bytes
        expected += 132
        a.t().unsqueeze(0)  # views
        a.view(-1)
        torch.empty(8, device="meta")
    assert counter.launches == 6
    assert counter.bytes == expected
    assert counter.read_by_dtype[torch.float16] == 32


def test_the_roofline_adds_launches_bytes_and_flops():
    part = Part(
        launches=10, syncs=0, read=3 * 10**12, written=10**12, flops=7 * 10**14, bytes_by_name={}
    )
    assert H200.seconds(part) == pytest.approx((40e-6, 1.0, 1.0))


def test_a_count_sees_a_pass_more_over_every_parameter():
    """The measurement itself: a pass over the weights after step() adds 8 bytes per element."""

    plain = count_iteration(lambda p: mixedopt.SGD(p, lr=0.1, foreach=True), ACCELERATOR)
    extra = count_iteration(sgd_with_a_pass_more, ACCELERATOR)
    assert extra.step.bytes - plain.step.bytes == 8 * plain.params

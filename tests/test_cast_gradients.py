"""Under mixedopt.autocast a weight's 16-bit gradient becomes its .grad as the matmul made it.

The storage's pre-hook on each weight's cast (``GradientStorage.cast_hook``) takes the float16
(or bfloat16) gradient that reaches the cast and stores it with scale 1, so autograd never makes
its float32 copy. Gradients stored alone (larger than a bucket's) take this path: weights of
65,536 elements with the CPU's budget, and of more than 16 with an accelerator's given to the
CPU. Parity is judged against torch.optim under torch.autocast, fed autograd's own gradients.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from helpers import accelerator_budget
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import mixedopt
from mixedopt import _storage, _takeover

BUDGETS = {"cpu": contextlib.nullcontext, "accelerator": accelerator_budget}


def model(tied=True):
    """Weights of 65,536 and 76,800 elements; ``tied``: the embedding's is also the head's."""
    torch.manual_seed(0)
    embedding = nn.Embedding(300, 256)
    head = nn.Linear(256, 300, bias=False)
    if tied:  # one weight for a float32 lookup and a float16 product: two gradients
        head.weight = embedding.weight
    return nn.ModuleDict(
        {
            "embedding": embedding,
            "mlp": nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)),
            "head": head,
        }
    )


def loss_of(net, tokens, factor=1.0):
    return net["head"](net["mlp"](net["embedding"](tokens))).float().square().mean() * factor


def tokens(seed):
    return torch.randint(0, 300, (4, 6), generator=torch.Generator().manual_seed(seed))


def weights(net):
    return [net["mlp"][0].weight, net["mlp"][2].weight]


def backward_both(net, twin, dtype, seed=0, factor=1.0):
    """Backward of mixedopt.autocast on ``net`` and of torch.autocast on ``twin``."""
    with mixedopt.autocast("cpu", dtype=dtype):
        loss = loss_of(net, tokens(seed), factor)
    loss.backward()
    with torch.autocast("cpu", dtype=dtype):
        reference = loss_of(twin, tokens(seed), factor)
    reference.backward()


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_a_cast_weights_grad_is_the_gradient_of_torch_autocast_in_16_bits(budget, dtype):
    net, twin = model(), model()
    with BUDGETS[budget]():
        optimizer = mixedopt.AdamW(net.parameters(), grad_dtype=dtype)
        backward_both(net, twin, dtype)
        for p, q in zip(weights(net), weights(twin), strict=True):
            assert p.grad.dtype == dtype
            assert torch.equal(p.grad.float(), q.grad)  # stored as it is: scale 1
            assert torch.equal(optimizer.true_grad(p), q.grad)


class FloatCopies(TorchDispatchMode):
    """Records the shapes of the float32 tensors a float16 tensor is copied into."""

    def __init__(self):
        super().__init__()
        self.shapes = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if (
            isinstance(out, torch.Tensor)
            and out.dtype == torch.float32
            and source is not None
            and source.dtype == torch.float16
        ):
            self.shapes.append(tuple(out.shape))
        return out


def step_both(optimizer, reference):
    for opt in (optimizer, reference):
        opt.step()
        opt.zero_grad()


def assert_same_weights(net, twin):
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q)


def optimizer_and_region(library, net):
    """mixedopt's AdamW and mixedopt.autocast, or torch.optim's and torch.autocast."""
    if library == "mixedopt":
        return mixedopt.AdamW(net.parameters()), mixedopt.autocast
    return torch.optim.AdamW(net.parameters()), torch.autocast


@pytest.mark.parametrize("library", ["mixedopt", "torch"])
def test_backward_makes_no_float32_copy_of_a_saved_cast_weights_gradient(library):
    net = model()
    optimizer, region = optimizer_and_region(library, net)
    with region("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    with FloatCopies() as copies:
        loss.backward()
    # The second layer's weight: saved by its product (its input needs a gradient), so
    # mixedopt.autocast finds its cast. torch.autocast upcasts its gradient.
    found = (256, 256) in copies.shapes
    assert found == (library == "torch")
    assert optimizer.param_groups  # the optimizer (and so the storage) lived through backward


def over_data():
    """A first layer of 76,800 elements over data, which needs no gradient."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 300), nn.GELU(), nn.Linear(300, 256))


@pytest.mark.parametrize("library", ["mixedopt", "torch"])
def test_backward_makes_no_float32_copy_of_a_first_layers_gradient(library):
    """Its product saves its input, not its weight's cast: mixedopt.autocast searches for it."""
    net = over_data()
    optimizer, region = optimizer_and_region(library, net)
    with region("cpu", dtype=torch.float16):
        loss = net(torch.randn(4, 256)).float().square().mean()
    with FloatCopies() as copies:
        loss.backward()
    assert ((300, 256) in copies.shapes) == (library == "torch")
    assert optimizer.param_groups


@pytest.mark.parametrize("budget", BUDGETS)
def test_steps_over_data_give_the_weights_of_torch_optim_under_torch_autocast(budget):
    net, twin = over_data(), over_data()
    with BUDGETS[budget]():
        optimizer = mixedopt.AdamW(net.parameters(), lr=1e-2)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
        for seed in range(3):
            x = torch.randn(4, 256, generator=torch.Generator().manual_seed(seed))
            with mixedopt.autocast("cpu", dtype=torch.float16):
                net(x).float().square().mean().backward()
            with torch.autocast("cpu", dtype=torch.float16):
                twin(x).float().square().mean().backward()
            assert net[0].weight.grad.dtype == torch.float16
            assert torch.equal(net[0].weight.grad.float(), twin[0].weight.grad)
            step_both(optimizer, reference)
    assert_same_weights(net, twin)


@pytest.mark.parametrize("budget", BUDGETS)
def test_steps_give_the_weights_of_torch_optim_under_torch_autocast(budget):
    """Gradients float16 holds exactly (no tied weight adding two), so weights bit for bit."""
    net, twin = model(tied=False), model(tied=False)
    with BUDGETS[budget]():
        optimizer = mixedopt.AdamW(net.parameters(), lr=1e-2)
        reference = torch.optim.AdamW(twin.parameters(), lr=1e-2, foreach=False)
        for seed in range(3):
            backward_both(net, twin, torch.float16, seed)
            step_both(optimizer, reference)
    assert_same_weights(net, twin)


def test_clipping_and_a_loss_scale_give_the_weights_of_torch_optim():
    net, twin = model(tied=False), model(tied=False)
    optimizer = mixedopt.SGD(net.parameters(), lr=0.5, max_grad_norm=1e-3)
    reference = torch.optim.SGD(twin.parameters(), lr=0.5, foreach=False)
    scaler, twin_scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    for seed in range(2):
        with mixedopt.autocast("cpu", dtype=torch.float16):
            loss = loss_of(net, tokens(seed))
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
        with torch.autocast("cpu", dtype=torch.float16):
            twin_loss = loss_of(twin, tokens(seed))
        twin_scaler.scale(twin_loss).backward()
        twin_scaler.unscale_(reference)
        norm = torch.nn.utils.clip_grad_norm_(twin.parameters(), 1e-3)
        twin_scaler.step(reference)
        twin_scaler.update()
        assert torch.equal(optimizer.last_grad_norm, norm)
        optimizer.zero_grad()
        reference.zero_grad()
    assert_same_weights(net, twin)


@pytest.mark.parametrize("budget", BUDGETS)
def test_clipping_and_a_loss_scale_give_what_the_float32_store_gives(budget):
    """With an accelerator's budget the norm is reduced from the 16-bit gradients, in another
    order than ``clip_grad_norm_``'s: there the reference is mixedopt under torch.autocast."""
    nets = {region: model(tied=False) for region in (mixedopt.autocast, torch.autocast)}
    with BUDGETS[budget]():
        optimizers = {
            region: mixedopt.SGD(net.parameters(), lr=0.5, max_grad_norm=1e-3)
            for region, net in nets.items()
        }
        scalers = {region: torch.amp.GradScaler("cpu") for region in nets}
        for seed in range(2):
            for region, net in nets.items():
                with region("cpu", dtype=torch.float16):
                    loss = loss_of(net, tokens(seed))
                scalers[region].scale(loss).backward()
                scalers[region].step(optimizers[region])
                scalers[region].update()
                optimizers[region].zero_grad()
            norms = [optimizer.last_grad_norm for optimizer in optimizers.values()]
            assert torch.equal(*norms)
    for p, q in zip(*(net.parameters() for net in nets.values()), strict=True):
        assert torch.equal(p, q)


def test_gradients_added_up_are_those_stored_from_float32():
    """A cast's gradient added to another is the float32 store's, bit for bit: the tied weight's
    two in one backward, and every weight's over two backwards."""
    net, twin = model(), model()
    optimizer, float32_store = mixedopt.AdamW(net.parameters()), mixedopt.AdamW(twin.parameters())
    for seed in range(2):
        with mixedopt.autocast("cpu", dtype=torch.float16):
            loss = loss_of(net, tokens(seed))
        loss.backward()
        with torch.autocast("cpu", dtype=torch.float16):  # the float32 gradients' store
            reference = loss_of(twin, tokens(seed))
        reference.backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(optimizer.true_grad(p), float32_store.true_grad(q))


@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("reader", ["step", "clipping", "GradScaler"])
def test_an_inf_in_a_cast_weights_gradient_skips_the_step(budget, reader):
    """Backward stores it unread: step() reads it, or clipping's norm, or GradScaler's check."""
    net = model()
    before = [p.detach().clone() for p in net.parameters()]
    with BUDGETS[budget]():
        max_grad_norm = 1.0 if reader == "clipping" else None
        optimizer = mixedopt.AdamW(net.parameters(), max_grad_norm=max_grad_norm)
        with mixedopt.autocast("cpu", dtype=torch.float16):
            loss = loss_of(net, tokens(0), factor=1e30)  # float16 gradients overflow
        if reader == "GradScaler":
            scaler = torch.amp.GradScaler("cpu")
            scaler.scale(loss).backward()
            scaler.step(optimizer)
        else:
            loss.backward()
            optimizer.step()
        assert not weights(net)[1].grad.isfinite().all()
    assert optimizer.skipped_steps == 1
    for p, q in zip(net.parameters(), before, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize("budget", BUDGETS)
def test_step_in_backward_gives_the_weights_of_backward_then_step(budget):
    net, twin = model(), model()
    with BUDGETS[budget]():
        optimizer, reference = mixedopt.Adam(net.parameters()), mixedopt.Adam(twin.parameters())
        for seed in range(3):
            with mixedopt.autocast("cpu", dtype=torch.float16):
                loss = loss_of(net, tokens(seed))
            with optimizer.step_in_backward():
                loss.backward()
            with mixedopt.autocast("cpu", dtype=torch.float16):
                loss_of(twin, tokens(seed)).backward()
            reference.step()
            reference.zero_grad()
    assert_same_weights(net, twin)


def test_a_parameter_let_go_before_backward_gets_its_float32_gradient():
    net, twin = model(), model()
    optimizer = mixedopt.AdamW(net.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    optimizer.remove_grad_storage()
    loss.backward()
    with torch.autocast("cpu", dtype=torch.float16):
        loss_of(twin, tokens(0)).backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert p.grad.dtype == torch.float32
        assert torch.equal(p.grad, q.grad)


def test_the_takeover_check_knows_this_torchs_counts():
    """Else every cast's gradient is copied: correct, but the path this file tests is off."""
    assert len(_takeover._measure()) == 2


def casts_sharing_a_gradient(first, second):
    """Casts of two parameters to which autograd hands one and the same gradient tensor."""
    right = torch.ones(first.shape[1], 3, dtype=torch.float16)
    return ((first.half() + second.half()) @ right).float().sum()


def test_a_gradient_another_cast_still_holds_is_copied_not_taken():
    a, b = (nn.Parameter(torch.randn(300, 256)) for _ in range(2))
    optimizer = mixedopt.SGD([a, b], lr=0.1)  # noqa: F841 - holds the storage
    taken = []
    with torch.enable_grad():
        first, second = a.half(), b.half()
    for param, cast in ((a, first), (b, second)):
        hook = _storage.cast_hook(param, torch.float16)
        assert hook is not None
        cast.grad_fn.register_prehook(
            lambda grads, hook=hook: taken.append(grads[0]) or hook(grads)
        )
    ((first + second) @ torch.ones(256, 3, dtype=torch.float16)).float().sum().backward()
    assert taken[0] is taken[1]  # one tensor, handed to both
    assert a.grad.untyped_storage().data_ptr() != b.grad.untyped_storage().data_ptr()
    expected = b.grad.clone()
    a.grad.mul_(2)  # clip_grad_norm_ does this: the other gradient must not change
    assert torch.equal(b.grad, expected)


def test_a_gradient_nothing_else_holds_becomes_the_grad_without_a_copy():
    a = nn.Parameter(torch.randn(300, 256))
    optimizer = mixedopt.SGD([a], lr=0.1)  # noqa: F841 - holds the storage
    handed = []
    with torch.enable_grad():
        cast = a.half()
    hook = _storage.cast_hook(a, torch.float16)
    cast.grad_fn.register_prehook(
        lambda grads: handed.append(grads[0].untyped_storage().data_ptr()) or hook(grads)
    )
    (cast @ torch.ones(256, 3, dtype=torch.float16)).float().sum().backward()
    assert a.grad.untyped_storage().data_ptr() == handed[0]


def test_a_sparse_gradient_is_never_held_by_nothing_else():
    """It has no storage of its own to count: the store copies it (were it ever handed over)."""
    assert not _takeover.sole_holder((torch.zeros(4, 4).to_sparse(),))


def test_torch_autograd_grad_returns_the_gradients_of_torch_autocast():
    """autograd.grad hands the gradients back, accumulating none: the casts keep theirs."""
    net, twin = model(tied=False), model(tied=False)
    optimizer = mixedopt.AdamW(net.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    found = torch.autograd.grad(loss, list(net.parameters()))
    with torch.autocast("cpu", dtype=torch.float16):
        expected = torch.autograd.grad(loss_of(twin, tokens(0)), list(twin.parameters()))
    for got, want in zip(found, expected, strict=True):
        assert torch.equal(got, want)
    assert all(p.grad is None for p in net.parameters())
    optimizer.remove_grad_storage()  # lets go at once: no gradient left claimed


def test_backward_with_inputs_stores_only_their_gradients():
    net, twin = model(tied=False), model(tied=False)
    optimizer = mixedopt.AdamW(net.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    loss.backward(inputs=[weights(net)[1]])
    with torch.autocast("cpu", dtype=torch.float16):
        loss_of(twin, tokens(0)).backward(inputs=[weights(twin)[1]])
    assert [p.grad is None for p in net.parameters()] == [p.grad is None for p in twin.parameters()]
    assert torch.equal(optimizer.true_grad(weights(net)[1]), weights(twin)[1].grad)


def test_gradients_a_cast_handed_over_are_stored_at_the_end_of_backward_at_the_latest(
    monkeypatch,
):
    """Were a parameter's own hook not to run after its cast's (autograd.grad taken for a
    backward that accumulates), its gradient is stored when the backward ends, not lost."""
    monkeypatch.setattr(_storage, "_accumulates", lambda slot: True)
    net, twin = model(tied=False), model(tied=False)
    optimizer = mixedopt.AdamW(net.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    torch.autograd.grad(loss, list(net.parameters()), allow_unused=True)
    with torch.autocast("cpu", dtype=torch.float16):
        loss_of(twin, tokens(0)).backward()
    for p, q in zip(weights(net), weights(twin), strict=True):
        assert torch.equal(optimizer.true_grad(p), q.grad)
    optimizer.remove_grad_storage()  # lets go at once: no gradient left claimed
    assert all(p.grad is None or p.grad.dtype == torch.float32 for p in net.parameters())


def test_a_parameters_own_hook_sees_the_float32_gradient_of_torch_autocast():
    net, twin = model(tied=False), model(tied=False)
    optimizer = mixedopt.AdamW(net.parameters())
    seen = []
    for p in (weights(net)[1], weights(twin)[1]):
        p.register_hook(lambda g: seen.append(g.clone()) or g * 0.5)
    backward_both(net, twin, torch.float16)
    ours, theirs = seen
    assert ours.dtype == torch.float32
    assert torch.equal(ours, theirs)
    assert torch.equal(optimizer.true_grad(weights(net)[1]), weights(twin)[1].grad)


def test_backward_creating_a_graph_stores_gradients_without_one():
    """As the float32 store does: ``.grad`` is the 16-bit value, outside any graph."""
    net = model(tied=False)
    optimizer = mixedopt.AdamW(net.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    with pytest.warns(UserWarning, match="reference cycle"):  # torch's, for create_graph
        loss.backward(create_graph=True)
    assert not any(p.grad.requires_grad for p in net.parameters())
    assert optimizer.param_groups


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_gradients_of_torch_autocast(reentrant):
    """``torch.utils.checkpoint`` runs the forward again in backward, casts included."""
    net, twin = model(tied=False), model(tied=False)
    optimizer, float32_store = mixedopt.AdamW(net.parameters()), mixedopt.AdamW(twin.parameters())
    x = net["embedding"](tokens(0)).detach().requires_grad_()
    with mixedopt.autocast("cpu", dtype=torch.float16):
        hidden = torch.utils.checkpoint.checkpoint(net["mlp"], x, use_reentrant=reentrant)
        loss = net["head"](hidden).float().square().mean()
    loss.backward()
    with torch.autocast("cpu", dtype=torch.float16):
        twin["head"](twin["mlp"](x)).float().square().mean().backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        if q.grad is not None:
            assert torch.equal(optimizer.true_grad(p), float32_store.true_grad(q))


def test_two_backwards_through_one_graph_add_up_as_the_float32_store_does():
    net, twin = model(tied=False), model(tied=False)
    optimizer, float32_store = mixedopt.AdamW(net.parameters()), mixedopt.AdamW(twin.parameters())
    with mixedopt.autocast("cpu", dtype=torch.float16):
        loss = loss_of(net, tokens(0))
    loss.backward(retain_graph=True)
    loss.backward()
    with torch.autocast("cpu", dtype=torch.float16):
        reference = loss_of(twin, tokens(0))
    reference.backward(retain_graph=True)
    reference.backward()
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):
        assert torch.equal(optimizer.true_grad(p), float32_store.true_grad(q))

"""step_in_backward(): backward updates the weights batch by batch as backward(); step() would."""

from __future__ import annotations

import copy
import gc
import io
import threading
import warnings

import pytest
import torch
from helpers import (
    OPTIMIZERS,
    assert_close_to_float32_noise,
    packing,
    scenarios,
    slice_elements,
    update_batch,
)
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

import mixedopt


class Pair:
    """The same parameters under two mixedopt optimizers: one steps, one steps in backward."""

    def __init__(self, name, kwargs, shapes, seed, **extra):
        generator = torch.Generator().manual_seed(seed)
        self.generator = generator
        data = [torch.randn(shape, generator=generator) for shape in shapes]
        self.stepped = [nn.Parameter(d.clone()) for d in data]
        self.updating = [nn.Parameter(d.clone()) for d in data]
        cls = OPTIMIZERS[name][0]
        self.opt = cls(self.stepped, **kwargs, **extra)
        self.in_backward = cls(self.updating, **kwargs, **extra)

    def losses(self, magnitude):
        """The loss of each set of parameters for one micro-batch: the same gradients."""
        scale = 10.0**magnitude
        grads = [torch.randn(p.shape, generator=self.generator) * scale for p in self.stepped]
        return [
            sum((p * g).sum() for p, g in zip(params, grads, strict=True))
            for params in (self.stepped, self.updating)
        ]

    def iteration(self, magnitudes):
        """``len(magnitudes)`` micro-batches: backward(); step() against the updating backward."""
        for i, magnitude in enumerate(magnitudes):
            stepped, updating = self.losses(magnitude)
            stepped.backward()
            if i + 1 < len(magnitudes):
                updating.backward()
                continue
            with self.in_backward.step_in_backward():
                updating.backward()
        self.opt.step()
        self.opt.zero_grad()

    def assert_equal(self):
        for p, q in zip(self.updating, self.stepped, strict=True):
            assert p.grad is None
            torch.testing.assert_close(p, q, rtol=0, atol=0)
            mine, theirs = self.in_backward.state[p], self.opt.state[q]
            assert mine.keys() == theirs.keys()
            for key, value in theirs.items():
                torch.testing.assert_close(mine[key], value, rtol=0, atol=0)


@given(
    scenarios(),
    st.sampled_from([1, 4]),
    st.sampled_from([torch.float16, torch.bfloat16]),
    st.sampled_from([0, 100, mixedopt._in_backward.UPDATE_BATCH]),
)
def test_updating_backward_gives_the_weights_and_state_of_backward_then_step(
    s, micro_batches, grad_dtype, batch
):
    pair = Pair(s["name"], s["kwargs"], s["shapes"], s["seed"], grad_dtype=grad_dtype)
    # Small budgets make several buckets per backward and store larger gradients alone; a
    # batch of 0 updates each as it is stored, 100 some of them together, the default all of
    # these small models at the end of backward.
    with packing(s["packing"]), update_batch(batch):
        magnitudes = s["magnitudes"]
        for step in range(s["steps"]):
            first = step * micro_batches
            chosen = [magnitudes[(first + i) % len(magnitudes)] for i in range(micro_batches)]
            pair.iteration(chosen)
            pair.assert_equal()


@pytest.mark.slow  # torch.compile
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_updating_backward_gives_the_weights_of_a_fused_step(name):
    kwargs = {"lr": 1e-2, "fused": True}
    if name == "SGD":
        kwargs["momentum"] = 0.9
    pair = Pair(name, kwargs, [(40, 50), (50,), (3, 7)], seed=1)
    with slice_elements(1000):  # the (40, 50) weight is stored alone and updated by a kernel
        for _ in range(3):
            pair.iteration([0.0, -1.0])
            pair.assert_equal()


def two_layers():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 64))


def last_weight_updated(batch):
    """Whether the last layer's weight was updated when backward reached the first layer's
    output, and when it ended, with an update batch of ``batch`` elements.

    Its gradient (4096 elements) is stored alone, larger than the bucket budget; the biases
    (64 each) wait in a bucket stored when backward ends.
    """
    model = two_layers()
    opt = mixedopt.SGD(model.parameters(), lr=0.1)
    last = model[2].weight.detach().clone()
    seen = []
    x = torch.randn(8, 64, requires_grad=True)
    hidden = model[1](model[0](x))
    hidden.register_hook(lambda g: seen.append(not torch.equal(model[2].weight, last)))
    with slice_elements(1000), update_batch(batch), opt.step_in_backward():
        model[2](hidden).square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    (midway,) = seen
    return midway, not torch.equal(model[2].weight, last)


def test_later_layers_are_updated_before_backward_reaches_the_first():
    assert last_weight_updated(batch=4000) == (True, True)  # more than the batch: at once


def test_gradients_wait_for_the_end_of_backward_while_they_fit_the_update_batch():
    assert last_weight_updated(batch=5000) == (False, True)


def test_the_update_batch_bounds_the_gradients_an_updating_backward_holds():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32, bias=False) for _ in range(6)])
    opt = mixedopt.SGD(model.parameters(), lr=0.1)
    held = []
    out = torch.randn(4, 32)
    for i, layer in enumerate(model):
        out = layer(out)
        if i + 1 < len(model):
            # Runs when backward reaches this output: the gradients of the layers after it are in.
            out.register_hook(
                lambda g: held.append(sum(p.grad is not None for p in model.parameters()))
            )
    with slice_elements(500), update_batch(2560), opt.step_in_backward():
        out.square().mean().backward()
    # Each weight (1024 elements) is stored alone. Two wait; the third would take them past the
    # batch, so it updates them first, then waits.
    assert held == [1, 2, 1, 2, 1]
    assert all(p.grad is None for p in model.parameters())


def test_after_an_updating_backward_no_gradient_is_left_and_step_changes_nothing():
    model = two_layers()
    opt = mixedopt.Adam(model.parameters())
    with opt.step_in_backward():
        model(torch.randn(8, 64)).square().mean().backward()
    assert all(p.grad is None for p in model.parameters())
    weights = [p.detach().clone() for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    for p, w in zip(model.parameters(), weights, strict=True):
        assert torch.equal(p, w)


def test_a_parameter_without_gradient_in_the_updating_backward_is_updated_from_earlier_ones():
    model = two_layers()
    opt = mixedopt.SGD(model.parameters(), lr=0.1)
    model(torch.randn(8, 64)).square().mean().backward()
    first = model[0].weight.grad.float() / opt._grad_storage.scale_of(model[0].weight)
    before = model[0].weight.detach().clone()
    with opt.step_in_backward():  # reaches the last layer only
        model[2](torch.randn(8, 64)).square().mean().backward()
    assert_close_to_float32_noise(model[0].weight, before - 0.1 * first)
    assert model[0].weight.grad is None


def test_lr_scheduler_steps_unchanged_without_warning():
    model, twin_model = two_layers(), two_layers()
    opt = mixedopt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref = mixedopt.SGD(twin_model.parameters(), lr=0.1, momentum=0.9)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    ref_schedule = torch.optim.lr_scheduler.StepLR(ref, step_size=1, gamma=0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "lr_scheduler.step() before optimizer.step()" among them
        for _ in range(3):
            x = torch.randn(8, 64)
            with opt.step_in_backward():
                model(x).square().mean().backward()
            schedule.step()
            twin_model(x).square().mean().backward()
            ref.step()
            ref.zero_grad()
            ref_schedule.step()
    assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"] == 0.1 * 0.5**3
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


def test_step_hooks_run_once_per_updating_backward():
    model = two_layers()
    opt = mixedopt.Adam(model.parameters())
    calls = []
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    for _ in range(2):
        with slice_elements(1000), opt.step_in_backward():
            model(torch.randn(8, 64)).square().mean().backward()
    assert calls == ["post", "post"]


def test_checkpoint_mid_training_continues_as_backward_then_step():
    pair = Pair("Adam", {"lr": 1e-2}, [(5, 4), (4,)], seed=3)
    pair.iteration([0.0])
    buffer = io.BytesIO()
    torch.save(pair.in_backward.state_dict(), buffer)
    buffer.seek(0)
    pair.in_backward = mixedopt.Adam(pair.updating, lr=1e-2)
    pair.in_backward.load_state_dict(torch.load(buffer))
    for _ in range(2):
        pair.iteration([0.0, 1.0])
        pair.assert_equal()


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradient_stops_the_updates_and_leaves_the_rest_untouched(bad):
    model, twin_model = two_layers(), two_layers()
    opt = mixedopt.Adam(model.parameters())
    ref = mixedopt.Adam(twin_model.parameters())
    x = torch.randn(8, 64)
    for net, optimizer in ((model, opt), (twin_model, ref)):  # state exists
        net(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    first = [model[0].weight, model[0].bias]
    before = [p.detach().clone() for p in first]
    state = [copy.deepcopy(opt.state[p]) for p in first]
    x = torch.randn(8, 64)
    hidden = model[1](model[0](x))
    hidden.register_hook(lambda g: g * bad)  # the first layer's gradients only
    found = r"inf or NaN.* 1 parameter\(s\) had been updated.*other 3 keep"
    with pytest.warns(RuntimeWarning, match=found):
        with slice_elements(1000), update_batch(0), opt.step_in_backward():
            model[2](hidden).square().mean().backward()
    for p, w, s in zip(first, before, state, strict=True):
        assert torch.equal(p, w)
        for key, value in s.items():
            assert torch.equal(opt.state[p][key], value)
    # The last layer's weight, larger than the budget, was stored and updated first (a batch of
    # 0: what is stored is updated at once).
    twin_model(x).square().mean().backward()
    ref.step()
    assert_close_to_float32_noise(model[2].weight, twin_model[2].weight)
    assert all(p.grad is None for p in model.parameters())
    assert opt.skipped_steps == 1


def test_a_backward_that_raises_ends_the_mode_and_keeps_the_gradients_not_used():
    model = two_layers()
    opt = mixedopt.SGD(model.parameters(), lr=0.1)

    def fail(grad):
        raise ValueError("boom")

    hidden = model[1](model[0](torch.randn(8, 64)))
    hidden.register_hook(fail)
    with pytest.raises(ValueError, match="boom"), opt.step_in_backward():
        model[2](hidden).square().mean().backward()
    with opt.step_in_backward():  # the mode ended: it can be entered again
        model(torch.randn(8, 64)).square().mean().backward()
    assert all(p.grad is None for p in model.parameters())


def test_a_gradient_stored_outside_backward_in_the_mode_is_used_at_once():
    model, twin = two_layers(), two_layers()
    opt = mixedopt.SGD(model.parameters(), lr=0.1)
    reference = mixedopt.SGD(twin.parameters(), lr=0.1)
    x = torch.randn(8, 64)

    def fail(grad):
        raise ValueError("boom")

    with opt.step_in_backward():
        hidden = model[1](model[0](x))
        hidden.register_hook(fail)
        with pytest.raises(ValueError, match="boom"):
            model[2](hidden).square().mean().backward()
        # The last layer's gradients wait unstored; true_grad() stores them, outside any
        # backward, and the mode updates their parameters then, as it would in backward.
        assert opt.true_grad(model[2].weight) is None
        assert all(p.grad is None for p in model.parameters())
        updated = [p.detach().clone() for p in model.parameters()]
    twin[2](twin[1](twin[0](x)).detach()).square().mean().backward()
    reference.step()
    for p, q in zip(updated, twin.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_max_grad_norm_is_refused():
    model = two_layers()
    opt = mixedopt.Adam(model.parameters(), max_grad_norm=1.0)
    with pytest.raises(RuntimeError, match="max_grad_norm clips by the norm of all gradients"):
        with opt.step_in_backward():
            pass


@pytest.mark.parametrize(
    ("grad_dtype", "error", "message"),
    [
        (torch.float16, RuntimeError, "GradScaler stepped mixedopt.Adam after a step_in"),
        # GradScaler unscales bfloat16 gradients itself and finds none: its own error.
        (torch.bfloat16, AssertionError, "No inf checks were recorded for this optimizer"),
    ],
)
def test_grad_scaler_is_refused_at_its_step(grad_dtype, error, message):
    model = two_layers()
    opt = mixedopt.Adam(model.parameters(), grad_dtype=grad_dtype)
    scaler = torch.amp.GradScaler("cpu")
    with opt.step_in_backward():
        scaler.scale(model(torch.randn(8, 64)).square().mean()).backward()
    with pytest.raises(error, match=message):
        scaler.step(opt)


def test_two_optimizers_step_in_the_same_backward_as_after_it():
    model, twin_model = two_layers(), two_layers()
    body, head = mixedopt.Adam(model[0].parameters()), mixedopt.SGD(model[2].parameters(), lr=0.1)
    ref_body = mixedopt.Adam(twin_model[0].parameters())
    ref_head = mixedopt.SGD(twin_model[2].parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(8, 64)
        # A bucket holds gradients of both: each optimizer is handed its own.
        with body.step_in_backward(), head.step_in_backward():
            model(x).square().mean().backward()
        twin_model(x).square().mean().backward()
        for opt in (ref_body, ref_head):
            opt.step()
            opt.zero_grad()
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert p.grad is None
        torch.testing.assert_close(p, q, rtol=0, atol=0)


def test_parameters_held_by_another_optimizer_are_refused():
    model = two_layers()
    opt = mixedopt.Adam(model.parameters())
    other = mixedopt.SGD(model[2].parameters(), lr=0.1)  # noqa: F841 - holds them while alive
    with pytest.raises(RuntimeError, match=r"2 parameter\(s\) are also held by another"):
        with opt.step_in_backward():
            pass


def test_removed_grad_storage_is_refused():
    model = two_layers()
    opt = mixedopt.Adam(model.parameters())
    opt.remove_grad_storage()
    with pytest.raises(RuntimeError, match="remove_grad_storage"):
        with opt.step_in_backward():
            pass


def test_entering_twice_is_refused():
    opt = mixedopt.Adam(two_layers().parameters())
    with opt.step_in_backward():
        with pytest.raises(RuntimeError, match="already on"):
            with opt.step_in_backward():
                pass


def test_a_parameter_saved_for_backward_through_detach_makes_autograd_raise():
    """Its update comes before backward reads the saved value: autograd's own error, not a
    silently wrong gradient."""
    torch.manual_seed(0)
    first, second = nn.Linear(16, 16), nn.Linear(16, 16)
    opt = mixedopt.SGD([*first.parameters(), *second.parameters()], lr=0.1)
    hidden = first(torch.randn(4, 16))
    # The matmul saves second.weight for backward, out of autograd's view; second(hidden) comes
    # later, so backward reaches it, and second.weight's update, first.
    out = (hidden @ second.weight.detach()).tanh() + second(hidden)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        with slice_elements(100), update_batch(0), opt.step_in_backward():
            out.square().mean().backward()


@pytest.mark.parametrize("batch", [0, mixedopt._in_backward.UPDATE_BATCH])
@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_weights_of_backward_then_step(reentrant, batch):
    """A checkpointed block recomputes its forward in backward, with weights not updated yet."""
    from torch.utils.checkpoint import checkpoint

    def build():
        torch.manual_seed(0)
        return nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])

    def loss_of(blocks, x):
        for block in blocks:
            x = checkpoint(block, x, use_reentrant=reentrant)
        return x.square().mean()

    blocks, twin_blocks = build(), build()
    opt, ref = mixedopt.Adam(blocks.parameters()), mixedopt.Adam(twin_blocks.parameters())
    for _ in range(2):
        x = torch.randn(8, 64, requires_grad=reentrant)
        # A batch of 0: each weight is updated as soon as it is stored, before the blocks before
        # it recompute. Reentrant blocks run backwards of their own, whose ends update too.
        with slice_elements(1000), update_batch(batch), opt.step_in_backward():
            loss_of(blocks, x).backward()
        loss_of(twin_blocks, x).backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(blocks.parameters(), twin_blocks.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("batch", "shapes"),
    [
        # Each update as backward stores it: the (40, 50) weight, stored alone, comes last
        # (backward reaches the loss's terms last to first), the bucket of the others waits.
        (0, [(40, 50), (50,), (3, 7)]),
        # One update when backward ends: the (40, 50) weight comes first, and the update runs
        # before the bucket of the others is stored (the storage's end of backward comes next).
        (mixedopt._in_backward.UPDATE_BATCH, [(3, 7), (50,), (40, 50)]),
    ],
)
def test_an_optimizer_collected_while_a_bucket_is_updated_is_released_after_it(batch, shapes):
    # An optimizer that dies in a reference cycle is let go by a finalizer, whenever the garbage
    # collector runs: here in the middle of an update of the updating backward. Letting it go
    # stores what waits in the shared gradient storage, which must wait for that update to end
    # (the update holds the parameters' state), not call it again from inside itself.
    pair = Pair("RMSprop", {"lr": 1e-2}, shapes, seed=3)
    other = nn.Parameter(torch.randn(10))
    doomed = [mixedopt.RMSprop([other], lr=1e-2)]
    doomed.append(doomed)  # a cycle: only the garbage collector frees it
    stages = pair.in_backward._stages
    original = stages.update

    def collect_then_step(*args, **kwargs):
        if doomed:
            doomed.clear()
            gc.collect()  # runs the dead optimizer's finalizer now
        return original(*args, **kwargs)

    stages.update = collect_then_step
    finished = threading.Event()

    def iterate():
        with slice_elements(1000), update_batch(batch):
            pair.iteration([0.0])
        finished.set()

    worker = threading.Thread(target=iterate, daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert finished.is_set(), "the updating backward did not end"
    assert not doomed
    pair.assert_equal()
    assert other not in pair.opt._grad_storage  # the dead optimizer's parameter was let go

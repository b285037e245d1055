"""Gradient storage: what `.grad` holds after backward, and how it gets there."""

from __future__ import annotations

import copy
import gc
import math
import weakref

import pytest
import torch
from helpers import (
    OPTIMIZERS,
    assert_close_to_float32_noise,
    autocast_backward,
    fp32_grads,
    relative_error,
    small_model,
)
from hypothesis import given
from hypothesis import strategies as st
from parity import (
    accumulated,
    assert_within_documented_rounding,
    round_gradients_as_stored,
    stored_as_documented,
)
from torch import nn

import mixedopt


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16])
def test_grads_land_in_grad_dtype_and_params_stay_float32(name, grad_dtype):
    model = small_model()
    opt = OPTIMIZERS[name][0](model.parameters(), grad_dtype=grad_dtype)
    autocast_backward(model, torch.randn(4, 6))
    assert opt.grad_dtype == grad_dtype
    for p in model.parameters():
        assert p.dtype == torch.float32
        assert p.grad.dtype == grad_dtype


def test_default_grad_dtype_is_float16():
    assert mixedopt.Adam(small_model().parameters()).grad_dtype == torch.float16


@given(
    exponent=st.floats(min_value=-9, max_value=6),
    loss_scale_exponent=st.integers(min_value=0, max_value=24),
    numel=st.integers(min_value=1, max_value=300),
    spread=st.floats(min_value=0, max_value=4),
    seed=st.integers(min_value=0, max_value=2**16),
)
def test_stored_gradient_keeps_fp16_precision_at_any_magnitude(
    exponent, loss_scale_exponent, numel, spread, seed
):
    """Gradients from 1e-9 to 1e6, times loss scales up to 2**24, come back rounded as
    documented: within float16's unit of the largest magnitude.

    ``spread`` makes the entries of one tensor span that many decades.
    """
    generator = torch.Generator().manual_seed(seed)
    magnitudes = 10.0 ** (exponent - spread * torch.rand(numel, generator=generator))
    signs = torch.randint(0, 2, (numel,), generator=generator) * 2 - 1
    true_grad = (magnitudes * signs).float()
    loss_scale = 2.0**loss_scale_exponent
    p = nn.Parameter(torch.zeros(numel))
    opt = mixedopt.Adam([p])
    (p * (true_grad * loss_scale)).sum().backward()
    assert p.grad.dtype == torch.float16
    assert_within_documented_rounding(opt.true_grad(p) / loss_scale, true_grad)


@pytest.mark.parametrize("loss_scale", [1e-4, 1.0, 2.0**16])
def test_autocast_model_gradients_keep_fp16_precision(loss_scale):
    model = small_model()
    opt = mixedopt.Adam(model.parameters())
    x = torch.randn(8, 6)
    exact = fp32_grads(model, x, loss_scale)
    autocast_backward(model, x, loss_scale)
    for p, g in zip(model.parameters(), exact, strict=True):
        assert_within_documented_rounding(opt.true_grad(p), g)


def test_plain_fp16_storage_would_lose_small_gradients():
    """The reason for the storage scale: the same gradients rounded to fp16 flush to zero."""
    exact = torch.randn(1000) * 1e-8
    assert relative_error(exact.half().float(), exact) > 0.5
    p = nn.Parameter(torch.zeros(1000))
    opt = mixedopt.Adam([p])
    (p * exact).sum().backward()
    assert_within_documented_rounding(opt.true_grad(p), exact)


def test_gradient_accumulation_over_8_micro_batches_stays_within_3e_3():
    """Each sum rounded as documented (``parity.accumulated``), and within 3e-3 of float32
    accumulation, relatively (docs/grad.md)."""
    model = small_model()
    opt = mixedopt.SGD(model.parameters(), lr=0.1)
    per_micro_batch = [[] for _ in model.parameters()]
    for i in range(8):
        x = torch.randn(4, 6) * (1 + i)  # micro-batches of different magnitude
        scale = 10.0 ** (i - 4)
        for grads, g in zip(per_micro_batch, fp32_grads(model, x, scale), strict=True):
            grads.append(g)
        autocast_backward(model, x, scale)
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    for p, grads in zip(model.parameters(), per_micro_batch, strict=True):
        total = torch.zeros_like(p)
        for g in grads:
            total += g  # as autograd accumulates float32 gradients in .grad
        assert_close_to_float32_noise(opt.true_grad(p), accumulated(grads))
        assert relative_error(opt.true_grad(p), total) <= 3e-3


def test_gradient_assigned_by_hand_is_taken_as_the_true_gradient():
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.SGD([p], lr=1.0)
    p.grad = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float16)
    assert_close_to_float32_noise(opt.true_grad(p), torch.tensor([0.5, 1.0, 2.0]))
    opt.step()
    assert_close_to_float32_noise(p.detach(), torch.tensor([0.5, 0.0, -1.0]))


def test_backward_accumulates_onto_a_gradient_assigned_by_hand():
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.SGD([p], lr=1.0)
    p.grad = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float16)
    (p * 3).sum().backward()
    assert p.grad.dtype == torch.float16
    assert_close_to_float32_noise(opt.true_grad(p), torch.tensor([3.5, 4.0, 5.0]))


def test_true_grad_is_none_without_a_gradient():
    p = nn.Parameter(torch.ones(3))
    assert mixedopt.Adam([p]).true_grad(p) is None


def test_p_grad_holds_the_true_gradient_times_a_power_of_two():
    p = nn.Parameter(torch.ones(4))
    opt = mixedopt.Adam([p])
    (p * 3e-6).sum().backward()
    ratio = p.grad.float() / opt.true_grad(p)
    assert torch.all(ratio == ratio[0])
    mantissa, _ = torch.frexp(ratio[0])
    assert mantissa == 0.5


def test_autograd_grad_results_are_not_scaled():
    """torch.autograd.grad does not accumulate into .grad and must not see the storage scale."""
    p = nn.Parameter(torch.ones(3))
    mixedopt.Adam([p])
    (p * 1e-6).sum().backward()  # a stored gradient exists
    (g,) = torch.autograd.grad((p * 2.0).sum(), p)
    assert g.dtype == torch.float32
    assert_close_to_float32_noise(g, torch.full((3,), 2.0))


@pytest.mark.parametrize("set_to_none", [True, False])
def test_zero_grad_then_backward_gives_the_new_gradient(set_to_none):
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.Adam([p])
    (p * 1e4).sum().backward()
    opt.zero_grad(set_to_none=set_to_none)
    (p * 1e-7).sum().backward()
    assert p.grad.dtype == torch.float16
    assert_close_to_float32_noise(opt.true_grad(p), stored_as_documented(torch.full((3,), 1e-7)))


def test_zero_grad_set_to_none_false_keeps_fine_scale_for_small_gradients():
    """A large gradient once must not leave a coarse scale behind after in-place zeroing."""
    p = nn.Parameter(torch.ones(1000))
    opt = mixedopt.Adam([p])
    (p * 1e3).sum().backward()
    opt.zero_grad(set_to_none=False)
    g = torch.linspace(1e-9, 1e-6, 1000)
    (p * g).sum().backward()
    assert_within_documented_rounding(opt.true_grad(p), g)


def test_parameter_without_gradient_keeps_none():
    model = small_model()
    extra = nn.Parameter(torch.ones(2))
    opt = mixedopt.RMSprop([*model.parameters(), extra])
    autocast_backward(model, torch.randn(4, 6))
    opt.step()
    assert extra.grad is None
    assert len(opt.state[extra]) == 0
    assert_close_to_float32_noise(extra.detach(), torch.ones(2))


def test_tied_parameter_gets_the_sum_of_both_uses():
    shared = nn.Parameter(torch.randn(5, 5))
    opt = mixedopt.Adam([shared])
    x = torch.randn(3, 5)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = (x @ shared @ shared).float().sum()
    (exact,) = torch.autograd.grad(loss, shared, retain_graph=True)
    loss.backward()
    assert shared.grad.dtype == torch.float16
    assert_within_documented_rounding(opt.true_grad(shared), exact)


@pytest.mark.parametrize(
    "shape,memory_format",
    [((), None), ((0,), None), ((0, 3), None), ((2, 3, 4, 5), torch.channels_last), ((7,), None)],
)
def test_odd_shapes_and_layouts_are_stored_and_stepped(shape, memory_format):
    data = torch.randn(shape)
    if memory_format is not None:
        data = data.contiguous(memory_format=memory_format)
    p = nn.Parameter(data.clone())
    q = nn.Parameter(data.clone())
    opt = mixedopt.Adam([p], lr=0.1)
    ref = torch.optim.Adam([q], lr=0.1)
    g = torch.randn(shape)
    (p * g).sum().backward()
    assert p.grad.dtype == torch.float16
    if memory_format is not None:
        assert p.grad.is_contiguous(memory_format=memory_format)
    q.grad = stored_as_documented(g)
    opt.step()
    ref.step()
    assert_close_to_float32_noise(p, q)
    assert opt.state[p]["exp_avg"].stride() == ref.state[q]["exp_avg"].stride()


def test_optimizer_is_not_kept_alive_by_its_hooks():
    model = small_model()
    opt = mixedopt.Adam(model.parameters())
    autocast_backward(model, torch.randn(4, 6))
    alive = weakref.ref(opt)
    del opt
    gc.collect()
    assert alive() is None
    model.zero_grad()
    autocast_backward(model, torch.randn(4, 6))
    for p in model.parameters():
        assert p.grad.dtype == torch.float32
        assert p.grad_dtype == torch.float32


def test_dropping_the_optimizer_gives_back_true_fp32_gradients():
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.Adam([p])
    (p * 1e-7).sum().backward()
    del opt
    gc.collect()
    assert p.grad.dtype == torch.float32
    assert_close_to_float32_noise(p.grad, stored_as_documented(torch.full((3,), 1e-7)))


def test_remove_grad_storage_makes_parameters_plain_again():
    model = small_model()
    opt = mixedopt.Adam(model.parameters())
    x = torch.randn(4, 6)
    autocast_backward(model, x)
    opt.remove_grad_storage()
    exact = fp32_grads(model, x)
    for p, g in zip(model.parameters(), exact, strict=True):
        assert p.grad.dtype == torch.float32
        assert_within_documented_rounding(p.grad, g)
    model.zero_grad()
    autocast_backward(model, x)
    for p, g in zip(model.parameters(), exact, strict=True):
        assert p.grad.dtype == torch.float32
        assert_close_to_float32_noise(p.grad, g)
    opt.step()  # still steps, on float32 gradients


def test_a_new_optimizer_can_take_over_after_remove_grad_storage():
    model = small_model()
    first = mixedopt.Adam(model.parameters())
    first.remove_grad_storage()
    second = mixedopt.SGD(model.parameters(), lr=0.1)
    autocast_backward(model, torch.randn(4, 6))
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    assert second.grad_dtype == torch.float16


def test_add_param_group_installs_storage_for_new_parameters():
    model = small_model()
    head = nn.Linear(3, 2)
    opt = mixedopt.Adam(model.parameters())
    opt.add_param_group({"params": head.parameters(), "lr": 1e-2})
    with torch.autocast("cpu", dtype=torch.float16):
        loss = head(model(torch.randn(4, 6))).float().sum()
    loss.backward()
    assert all(p.grad.dtype == torch.float16 for p in head.parameters())


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_an_optimizer_made_under_no_grad_or_inference_mode_stores_gradients(mode):
    model = small_model()
    with mode():
        opt = mixedopt.Adam(model.parameters())
    autocast_backward(model, torch.randn(4, 6))
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    opt.step()


def test_frozen_parameters_are_accepted_and_left_alone():
    model = small_model()
    model[0].weight.requires_grad_(False)
    opt = mixedopt.Adam(model.parameters())
    autocast_backward(model, torch.randn(4, 6))
    assert model[0].weight.grad is None
    assert model[0].weight.grad_dtype == torch.float32
    assert model[2].weight.grad.dtype == torch.float16
    opt.step()


def test_two_optimizers_over_the_same_parameters_step_as_torch_optims_do():
    """Both step on the one stored gradient, as two torch.optim optimizers would."""
    model = small_model()
    reference = copy.deepcopy(model)
    first, second = mixedopt.Adam(model.parameters(), lr=0.01), mixedopt.SGD(model.parameters())
    ref_first = torch.optim.Adam(reference.parameters(), lr=0.01)
    ref_second = torch.optim.SGD(reference.parameters())
    for _ in range(3):
        x = torch.randn(4, 6)
        autocast_backward(model, x)
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
        autocast_backward(reference, x)
        round_gradients_as_stored(reference.parameters())
        for opt in (first, second, ref_first, ref_second):
            opt.step()
        for opt in (first, second, ref_first, ref_second):
            opt.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


def test_gradient_storage_lasts_until_the_last_optimizer_holding_a_parameter_goes():
    model = small_model()
    first = mixedopt.Adam(model.parameters())
    second = mixedopt.Adam(model.parameters())
    del first
    gc.collect()
    autocast_backward(model, torch.randn(4, 6))
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    del second
    gc.collect()
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    model.zero_grad()
    autocast_backward(model, torch.randn(4, 6))
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())


def test_remove_grad_storage_keeps_the_storage_another_optimizer_holds():
    model = small_model()
    head = nn.Linear(3, 2)
    shared = mixedopt.Adam(model.parameters())
    removed = mixedopt.SGD([*model.parameters(), *head.parameters()])
    removed.remove_grad_storage()
    with torch.autocast("cpu", dtype=torch.float16):
        head(model(torch.randn(4, 6))).float().sum().backward()
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    assert all(p.grad.dtype == torch.float32 for p in head.parameters())  # held by none
    assert shared.grad_dtype == torch.float16


def test_an_optimizer_recreated_from_a_checkpoint_beside_the_old_one_continues_training():
    """What frameworks do when they resume: the old optimizer may still be alive."""
    model = small_model()
    reference = copy.deepcopy(model)
    old, ref = (
        mixedopt.Adam(model.parameters(), lr=0.01),
        torch.optim.Adam(reference.parameters(), lr=0.01),
    )
    x = torch.randn(4, 6)

    def train(opt, ref_opt):
        autocast_backward(model, x)
        autocast_backward(reference, x)
        round_gradients_as_stored(reference.parameters())
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()

    train(old, ref)
    new = mixedopt.Adam(model.parameters(), lr=0.01)
    new.load_state_dict(old.state_dict())
    train(new, ref)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)
        assert_close_to_float32_noise(new.state[p]["exp_avg"], ref.state[q]["exp_avg"])


FLOAT32 = st.floats(width=32, allow_nan=True, allow_infinity=True)


@given(values=st.lists(FLOAT32, min_size=0, max_size=6))
def test_the_scale_found_on_the_host_is_the_scale_found_on_the_device(values):
    """Gradients stored alone on a CPU read their largest magnitude and find their scale on the
    host; the buckets and the accelerators compute both with tensor operations."""
    from mixedopt._scales import (
        abs_max,
        abs_max_on_host,
        power_of_two_scale,
        power_of_two_scale_on_host,
    )

    t = torch.tensor(values, dtype=torch.float32)
    on_device, on_host = abs_max(t), abs_max_on_host(t)
    torch.testing.assert_close(
        torch.tensor(on_host, dtype=torch.float32), on_device, rtol=0, atol=0, equal_nan=True
    )
    assert power_of_two_scale_on_host(on_host) == power_of_two_scale(on_device).item()


@given(st.floats(min_value=2.0**-119, max_value=torch.finfo(torch.float32).max, width=32))
def test_the_storage_scale_puts_the_largest_magnitude_in_two_to_the_7_to_8(amax):
    """The scale looked up in a table of binades is what frexp and its exponent give."""
    from mixedopt._scales import power_of_two_scale

    scale = power_of_two_scale(torch.tensor([amax])).item()
    assert math.frexp(scale)[0] == 0.5  # a power of two
    assert 2**7 <= amax * scale < 2**8


@pytest.mark.parametrize("amax", [0.0, 1e-45, 2.0**-126, 2.0**-120])
def test_zero_and_the_smallest_magnitudes_get_the_largest_storage_scale(amax):
    from mixedopt._scales import power_of_two_scale, power_of_two_scale_on_host

    assert power_of_two_scale(torch.tensor(amax)).item() == 2.0**126
    assert power_of_two_scale_on_host(amax) == 2.0**126


@given(values=st.lists(FLOAT32, min_size=1, max_size=6))
def test_a_storage_scale_is_finite_whatever_the_gradient(values):
    """step() looks for inf and NaN in whole stats tables, scales included: only a bound may
    make them non-finite."""
    from mixedopt._scales import abs_max, power_of_two_scale, power_of_two_scale_on_host

    amax = abs_max(torch.tensor(values, dtype=torch.float32))
    assert power_of_two_scale(amax).isfinite().item()
    assert math.isfinite(power_of_two_scale_on_host(amax.item()))


def stored_alone(g: torch.Tensor, memory_format, held_elsewhere: bool):
    """``(p.grad, storage scale, what a hook kept)`` of a parameter whose gradient is ``g``.

    ``held_elsewhere``: a hook of the parameter keeps the gradient autograd hands it, so that
    the store may not overwrite it.
    """
    data = torch.zeros(g.shape)
    if memory_format is not None:
        data = data.contiguous(memory_format=memory_format)
    p = nn.Parameter(data)
    opt = mixedopt.SGD([p], lr=0.1)
    kept: list[torch.Tensor] = []
    if held_elsewhere:
        p.register_hook(kept.append)
    (p * g).sum().backward()
    assert p.grad.numel() > mixedopt._budget.budget(p.device).bucket_small  # stored alone
    assert p.grad.stride() == p.stride()
    return p.grad, opt._grad_storage.scale_of(p), kept


def magnitudes_over_twelve_decades(shape) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    return torch.randn(shape, generator=generator) * 10.0 ** torch.randint(
        -8, 4, shape, generator=generator
    )


@pytest.mark.parametrize(
    "shape,memory_format", [((40_000,), None), ((8, 5, 25, 40), torch.channels_last)]
)
def test_a_gradient_stored_alone_is_the_same_scaled_in_place_at_once_or_in_pieces(
    monkeypatch, shape, memory_format
):
    """A gradient above the bucket limit that nothing else holds is scaled where it is, then
    rounded; one held elsewhere is scaled in one multiplication up to ``SCRATCH_PIECE``
    elements and in pieces above (the reference paths): all hold ``true * scale`` rounded
    once."""
    g = magnitudes_over_twelve_decades(shape)
    stored = {}
    # 40,000 elements: in place, then at once, then in 40 pieces
    for way, held_elsewhere, piece in (
        ("in place", False, 1 << 18),
        ("at once", True, 1 << 18),
        ("in pieces", True, 1000),
    ):
        monkeypatch.setattr(mixedopt._scales, "SCRATCH_PIECE", piece)
        grad, scale, _ = stored_alone(g, memory_format, held_elsewhere)
        torch.testing.assert_close(grad, (g * scale).half(), rtol=0, atol=0)
        stored[way] = grad
    assert torch.equal(stored["in place"], stored["at once"])
    assert torch.equal(stored["in place"], stored["in pieces"])


def test_a_gradient_whose_elements_share_memory_is_stored_alone():
    """The gradient of a sum is one value expanded to the parameter's shape (strides 0): not
    scaled where it is, which would write one element many times."""
    p = nn.Parameter(torch.zeros(300, 256))
    opt = mixedopt.SGD([p], lr=0.1)
    (p.sum() * 3).backward()
    twin = torch.zeros(300, 256, requires_grad=True)
    (twin.sum() * 3).backward()
    scale = opt._grad_storage.scale_of(p)
    torch.testing.assert_close(p.grad, (twin.grad * scale).half(), rtol=0, atol=0)


def test_a_float32_gradient_held_elsewhere_is_not_changed_by_its_store():
    g = magnitudes_over_twelve_decades((40_000,))
    grad, scale, kept = stored_alone(g, None, held_elsewhere=True)
    assert scale != 1.0  # a store that scaled in place would have changed what the hook kept
    assert torch.equal(kept[0], g)


def test_a_float32_gradient_two_parameters_share_is_stored_right_for_both():
    """An addition hands both of its inputs one gradient tensor: the first store may not scale
    it where it is, or the second would store it scaled twice."""
    a, b = (nn.Parameter(torch.zeros(300, 256)) for _ in range(2))
    opt = mixedopt.SGD([a, b], lr=0.1)
    right = magnitudes_over_twelve_decades((256, 3))
    ((a + b) @ right).sum().backward()
    twin = torch.zeros(300, 256, requires_grad=True)
    (twin @ right).sum().backward()
    for p in (a, b):
        scale = opt._grad_storage.scale_of(p)
        torch.testing.assert_close(p.grad, (twin.grad * scale).half(), rtol=0, atol=0)


@given(st.floats(-9, 6), st.integers(0, 2**16))
def test_elements_down_to_2_to_the_minus_21_of_the_largest_keep_float16_precision(exponent, seed):
    """docs/grad.md ("How close to float32 training"), README: about 5e-7 of the largest."""
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(1000, generator=generator) * 10.0 ** (
        exponent - 8 * torch.rand(1000, generator=generator)
    )
    p = nn.Parameter(torch.zeros(1000))
    opt = mixedopt.Adam([p])
    (p * g).sum().backward()
    error = (opt.true_grad(p) - g).abs()
    kept = g.abs() >= g.abs().max() * 2.0**-21
    assert kept.sum() > 0
    assert (error[kept] <= 2.0**-11 * g.abs()[kept]).all()


def test_an_element_eight_decades_below_its_largest_keeps_fewer_bits():
    """The per-tensor scale: 1e-8 next to 1 is a float16 subnormal (a few bits)."""
    g = torch.tensor([1.0, 1e-4, 1e-6, 1e-8])
    p = nn.Parameter(torch.zeros(4))
    opt = mixedopt.Adam([p])
    (p * g).sum().backward()
    relative = ((opt.true_grad(p) - g).abs() / g).tolist()
    assert max(relative[:3]) <= 2.0**-11
    assert relative[3] > 2.0**-11 * 10

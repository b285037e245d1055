"""Code that reads or changes ``p.grad`` before ``step()``: clipping, norm logging, GradScaler.

float16 gradients hold a per-tensor storage scale, so such code is warned about once; bfloat16
gradients hold true values, so it gets the right answer.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import OPTIMIZERS, assert_close_to_float32_noise, autocast_backward, small_model, twin
from parity import stored_as_documented
from torch import nn

import mixedopt


def clip(model, max_norm=0.1):
    return torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)


def test_bfloat16_gradients_hold_true_values():
    model = small_model()
    opt = mixedopt.AdamW(model.parameters(), grad_dtype=torch.bfloat16)
    autocast_backward(model, torch.randn(8, 6))
    for p in model.parameters():
        assert torch.equal(p.grad.float(), opt.true_grad(p))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_clip_grad_norm_on_bfloat16_gradients_gives_the_norm_of_float32_gradients(name):
    """And step() updates with what clipping left, as torch.optim does."""
    model = small_model()
    reference = twin(model)
    opt = OPTIMIZERS[name][0](model.parameters(), lr=0.1, grad_dtype=torch.bfloat16)
    ref = OPTIMIZERS[name][1](reference.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing to warn about
        for _ in range(3):
            autocast_backward(model, x)
            autocast_backward(reference, x)  # float32 gradients
            exact = torch.nn.utils.get_total_norm([q.grad for q in reference.parameters()])
            norm = clip(model)
            # bfloat16 keeps 8 significant bits: the norm of rounded gradients is that close.
            torch.testing.assert_close(norm.float(), exact, rtol=2**-7, atol=0)
            # torch.optim is fed the twin's gradients rounded as stored, clipped the same way.
            holders = []
            for q in reference.parameters():
                holders.append(torch.zeros_like(q, dtype=torch.bfloat16, requires_grad=True))
                holders[-1].grad = stored_as_documented(q.grad, torch.bfloat16).bfloat16()
            assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(holders, 0.1))
            for p, q, holder in zip(
                model.parameters(), reference.parameters(), holders, strict=True
            ):
                assert torch.equal(opt.true_grad(p), holder.grad.float())
                q.grad = holder.grad.float()
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_clip_grad_norm_on_float16_gradients_warns_once_naming_max_grad_norm(name):
    model = small_model()
    opt = OPTIMIZERS[name][0](model.parameters(), lr=0.1)
    x = torch.randn(8, 6)
    autocast_backward(model, x)
    clip(model)
    with pytest.warns(UserWarning, match=r"changed in place.*clip_grad_norm_.*max_grad_norm="):
        opt.step()
    opt.zero_grad()
    autocast_backward(model, x)
    clip(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer


def test_gradients_zeroed_in_place_before_a_backward_that_skips_them_do_not_warn():
    model = small_model()
    opt = mixedopt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(8, 6)
    autocast_backward(model, x)
    opt.step()
    opt.zero_grad(set_to_none=False)
    with torch.autocast("cpu", dtype=torch.float16):
        model[0](x).float().square().mean().backward()  # the last layer gets no gradient
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_a_step_without_code_touching_the_gradients_does_not_warn():
    model = small_model()
    opt = mixedopt.AdamW(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            autocast_backward(model, torch.randn(8, 6))
            opt.step()
            opt.zero_grad()


def test_gradscaler_leaves_unscaling_to_float16_optimizers_only():
    """With bfloat16 it unscales as for torch.optim: frameworks then allow clipping."""
    params = list(small_model().parameters())
    assert mixedopt.Adam(params, fused=True)._step_supports_amp_scaling is True
    bf16 = mixedopt.Adam(list(small_model().parameters()), fused=True, grad_dtype=torch.bfloat16)
    assert bf16._step_supports_amp_scaling is False


def test_gradscaler_unscale_then_clip_on_bfloat16_gradients_matches_torch_optim():
    """torch.optim is fed the twin's float32 gradients through the same code on bfloat16
    tensors: the scaled gradient rounded to bfloat16 as the storage documents, GradScaler's
    unscale and clip_grad_norm_ (which computes in bfloat16), then the float32 update."""
    generator = torch.Generator().manual_seed(0)
    shapes = [(6, 10), (10,), (3, 10)]
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    params = [nn.Parameter(t.clone()) for t in initial]
    reference = [nn.Parameter(t.clone()) for t in initial]
    opt = mixedopt.SGD(params, lr=0.1, momentum=0.9, grad_dtype=torch.bfloat16)
    ref = torch.optim.SGD(reference, lr=0.1, momentum=0.9)
    scale = 2.0**10
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    for step in range(3):
        grads = [torch.randn(shape, generator=generator) * 10.0 ** (step - 1) for shape in shapes]
        scaler.scale(sum((p * g).sum() for p, g in zip(params, grads, strict=True))).backward()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(params, 0.1)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()

        scaled = scale * sum((q * g).sum() for q, g in zip(reference, grads, strict=True))
        holders = [torch.zeros(shape, dtype=torch.bfloat16, requires_grad=True) for shape in shapes]
        for holder, g in zip(holders, torch.autograd.grad(scaled, reference), strict=True):
            # Rounded as stored, then unscaled as GradScaler does (exactly: a power of two).
            holder.grad = stored_as_documented(g, torch.bfloat16).bfloat16() / scale
        torch.nn.utils.clip_grad_norm_(holders, 0.1)
        for q, holder in zip(reference, holders, strict=True):
            q.grad = holder.grad.float()
        ref.step()
        ref.zero_grad()
        assert scaler.get_scale() == scale  # no inf found, and no growth yet
        for p, q in zip(params, reference, strict=True):
            assert_close_to_float32_noise(p, q)


def test_pickled_bfloat16_optimizer_keeps_leaving_unscaling_to_gradscaler():
    import copy

    opt = mixedopt.Adam(small_model().parameters(), grad_dtype=torch.bfloat16)
    assert copy.deepcopy(opt)._step_supports_amp_scaling is False


def test_clipping_float16_gradients_by_a_coefficient_of_one_does_not_warn():
    """Hugging Face's Trainer calls clip_grad_norm_(params, inf) only to log a norm."""
    model = small_model()
    opt = mixedopt.AdamW(model.parameters())
    autocast_backward(model, torch.randn(8, 6))
    clip(model, max_norm=float("inf"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()


def test_clip_grad_norm_warns_with_gradients_of_no_elements_among_them():
    params = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(0))]
    opt = mixedopt.SGD(params, lr=0.1)
    sum((p * 2.0).sum() for p in params).backward()
    torch.nn.utils.clip_grad_norm_(params, 1e-3)
    with pytest.warns(UserWarning, match="changed in place"):
        opt.step()

"""The same behaviour on a CUDA device (skipped where there is none)."""

from __future__ import annotations

import warnings

import pytest
import torch
from helpers import OPTIMIZERS, assert_close_to_float32_noise
from parity import assert_within_documented_rounding, round_gradients_as_stored
from torch import nn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 10)).cuda()


def cuda_grads(model, x):
    with torch.autocast("cuda", dtype=torch.float16):
        loss = model(x).float().square().mean()
    return loss


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_step_on_cuda_matches_torch_optim(name):
    model = mlp()
    ref_model = mlp()
    opt = OPTIMIZERS[name][0](model.parameters(), lr=1e-3)
    ref = OPTIMIZERS[name][1](ref_model.parameters(), lr=1e-3)
    for _ in range(3):
        x = torch.randn(32, 64, device="cuda")
        cuda_grads(model, x).backward()
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
        cuda_grads(ref_model, x).backward()
        round_gradients_as_stored(ref_model.parameters())
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


def test_backward_hooks_do_not_synchronise_with_the_host():
    model = mlp()
    opt = OPTIMIZERS["Adam"][0](model.parameters())
    x = torch.randn(32, 64, device="cuda")
    for _ in range(2):  # the second backward accumulates
        loss = cuda_grads(model, x)
        torch.cuda.set_sync_debug_mode("error")
        try:
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert opt.grad_dtype == torch.float16


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_default_step_on_cuda_synchronises_with_the_host_once(name):
    """To read whether a gradient is inf or NaN (``tests/test_launches.py`` counts it too)."""
    params = [nn.Parameter(torch.randn(n, device="cuda")) for n in (10, 5000, 2_000_000)]
    opt = OPTIMIZERS[name][0](params, lr=1e-3)
    for _ in range(3):  # the first two make the state and every kept tensor
        sum((p * 2.0).sum() for p in params).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                opt.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1


def test_small_gradients_keep_fp16_precision_on_cuda():
    p = nn.Parameter(torch.zeros(4096, device="cuda"))
    opt = OPTIMIZERS["SGD"][0]([p], lr=0.1)
    g = torch.randn(4096, device="cuda") * 1e-9
    (p * g).sum().backward()
    assert_within_documented_rounding(opt.true_grad(p).cpu(), g.cpu())


def test_grad_scaler_on_cuda_skips_inf_steps():
    model = mlp()
    opt = OPTIMIZERS["AdamW"][0](model.parameters(), max_grad_norm=1.0)
    scaler = torch.amp.GradScaler("cuda")
    x = torch.randn(32, 64, device="cuda")
    scaler.scale(cuda_grads(model, x)).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(cuda_grads(model, x) * float("inf")).backward()
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_step_in_backward_on_cuda_matches_backward_then_step(name, fused):
    model, twin_model = mlp(), mlp()
    opt = OPTIMIZERS[name][0](model.parameters(), lr=1e-3, fused=fused)
    ref = OPTIMIZERS[name][0](twin_model.parameters(), lr=1e-3, fused=fused)
    for _ in range(3):
        x = torch.randn(32, 64, device="cuda")
        with opt.step_in_backward():
            cuda_grads(model, x).backward()
        cuda_grads(twin_model, x).backward()
        ref.step()
        ref.zero_grad()
    for p, q in zip(model.parameters(), twin_model.parameters(), strict=True):
        assert p.grad is None
        assert_close_to_float32_noise(p, q)


def test_mixedopt_autocast_hands_a_large_weight_its_float16_gradient_on_cuda():
    """A weight stored alone on a GPU (more than 1Mi elements) gets its product's float16
    gradient as its .grad: torch.autocast's values, and no host synchronisation."""
    import mixedopt

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(64, 1280), nn.GELU(), nn.Linear(1280, 1024)).cuda()

    net, twin = model(), model()
    opt = mixedopt.AdamW(net.parameters())
    x = torch.randn(32, 64, device="cuda")
    with mixedopt.autocast("cuda", dtype=torch.float16):
        loss = net(x).float().square().mean()
    torch.cuda.set_sync_debug_mode("error")
    try:
        loss.backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    with torch.autocast("cuda", dtype=torch.float16):
        twin(x).float().square().mean().backward()
    large = net[2].weight  # 1,310,720 elements; its cast is saved (its input needs a gradient)
    assert large.grad.dtype == torch.float16
    assert torch.equal(large.grad.float(), twin[2].weight.grad)
    assert torch.equal(opt.true_grad(large), twin[2].weight.grad)
    for p, q in zip(net.parameters(), twin.parameters(), strict=True):  # the others, bucketed
        assert_within_documented_rounding(opt.true_grad(p), q.grad)

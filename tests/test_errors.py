"""Bad input: clear errors, and nothing left behind."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import OPTIMIZERS, assert_close_to_float32_noise, autocast_backward, small_model
from torch import nn

import mixedopt


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize(
    "dtype", [torch.float16, torch.bfloat16, torch.float64, torch.complex64, torch.int32]
)
def test_non_float32_parameter_is_refused_naming_its_dtype(name, dtype):
    p = nn.Parameter(torch.zeros(3, dtype=dtype), requires_grad=dtype.is_floating_point)
    with pytest.raises(ValueError, match=rf"dtype {dtype}.*float32 master weights"):
        OPTIMIZERS[name][0]([p])


def test_refused_construction_leaves_parameters_plain():
    good = nn.Parameter(torch.ones(2))
    bad = nn.Parameter(torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError):
        mixedopt.Adam([{"params": [good]}, {"params": [bad]}])
    assert good.grad_dtype == torch.float32
    (good * 2).sum().backward()
    assert good.grad.dtype == torch.float32


def test_a_parameter_created_under_inference_mode_is_refused_and_nothing_is_installed():
    good = nn.Parameter(torch.ones(2))
    with torch.inference_mode():
        made_there = nn.Parameter(torch.ones(2))
    with pytest.raises(ValueError, match=r"created under torch.inference_mode\(\).*outside"):
        mixedopt.Adam([good, made_there])
    (good * 2).sum().backward()
    assert good.grad.dtype == torch.float32


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.float64, torch.int8, "float16", None])
def test_bad_grad_dtype_is_refused(grad_dtype):
    with pytest.raises(ValueError, match="Invalid grad_dtype.*torch.float16 or torch.bfloat16"):
        mixedopt.Adam(small_model().parameters(), grad_dtype=grad_dtype)


@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0, float("nan")])
def test_non_positive_max_grad_norm_is_refused(max_grad_norm):
    with pytest.raises(ValueError, match="Invalid max_grad_norm value"):
        mixedopt.SGD(small_model().parameters(), max_grad_norm=max_grad_norm)


@pytest.mark.parametrize(
    "name,kwargs,message",
    [
        ("RMSprop", {"lr": -1.0}, "Invalid learning rate"),
        ("RMSprop", {"alpha": -0.5}, "Invalid alpha value"),
        ("Adam", {"betas": (1.0, 0.999)}, "Invalid beta parameter at index 0"),
        ("AdamW", {"eps": -1.0}, "Invalid epsilon value"),
        ("SGD", {"momentum": -0.1}, "Invalid momentum value"),
        ("SGD", {"nesterov": True}, "Nesterov momentum requires a momentum"),
    ],
)
def test_parent_validation_is_kept(name, kwargs, message):
    with pytest.raises(ValueError, match=message):
        OPTIMIZERS[name][0](small_model().parameters(), **kwargs)


@pytest.mark.parametrize(
    "name,flag",
    [
        ("RMSprop", "capturable"),
        ("RMSprop", "differentiable"),
        ("Adam", "capturable"),
        ("AdamW", "differentiable"),
        ("SGD", "differentiable"),
    ],
)
def test_unsupported_flags_are_refused_clearly(name, flag):
    with pytest.raises(ValueError, match=rf"does not support {flag}=True"):
        OPTIMIZERS[name][0](small_model().parameters(), **{flag: True})


def test_a_second_optimizer_asking_another_grad_dtype_for_a_parameter_is_refused():
    model = small_model()
    first = mixedopt.Adam(model.parameters())
    with pytest.raises(
        ValueError, match=r"already stored in torch.float16 .* grad_dtype=torch.float16"
    ):
        mixedopt.SGD(model.parameters(), grad_dtype=torch.bfloat16)
    autocast_backward(model, torch.randn(4, 6))
    assert all(p.grad.dtype == torch.float16 for p in model.parameters())
    assert first.grad_dtype == torch.float16


def test_refused_param_group_is_not_added():
    opt = mixedopt.Adam(small_model().parameters())
    with pytest.raises(ValueError, match="dtype torch.float16"):
        opt.add_param_group({"params": [nn.Parameter(torch.ones(2, dtype=torch.float16))]})
    assert len(opt.param_groups) == 1


def test_gradient_of_an_unusable_dtype_is_refused_at_step():
    p = nn.Parameter(torch.ones(2))
    opt = mixedopt.Adam([p])
    p.grad = torch.ones(2, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="gradient of dtype torch.float64"):
        opt.step()
    assert_close_to_float32_noise(p.detach(), torch.ones(2))


def test_max_grad_norm_is_a_global_attribute():
    model = small_model()
    opt = mixedopt.Adam(model.parameters(), max_grad_norm=1e-3)
    autocast_backward(model, torch.randn(4, 6))
    opt.step()
    assert opt.max_grad_norm == 1e-3
    assert opt.last_grad_norm > 1e-3


def test_a_parameter_converted_after_construction_is_refused_at_the_next_step():
    model = nn.Linear(4, 3)
    opt = mixedopt.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    model.half()
    with pytest.raises(RuntimeError, match=r"now torch\.float16.*model\.float\(\)"):
        opt.step()
    assert not opt.state  # nothing was updated


def test_letting_go_of_a_parameter_converted_after_construction_does_not_raise():
    model = nn.Linear(4, 3)
    opt = mixedopt.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    model.half()
    opt.remove_grad_storage()
    assert model.weight.grad.dtype == torch.float16 == model.weight.grad_dtype


def test_an_optimizer_of_a_converted_model_alive_at_exit_prints_nothing():
    # Its finalizer lets go of the parameters at interpreter exit (weakref's atexit hook).
    script = """
import torch, mixedopt
model = torch.nn.Linear(4, 3)
opt = mixedopt.AdamW(model.parameters())
model(torch.randn(2, 4)).sum().backward()
model.half()
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert result.returncode == 0
    assert result.stderr == ""

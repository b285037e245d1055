"""Rules of the optimizers beyond the four with compiled kernels, as torch.optim has them."""

from __future__ import annotations

import pytest
import torch
from helpers import EVERY_OPTIMIZER, OPTIMIZERS, assert_close_to_float32_noise, slice_elements
from parity import round_gradients_as_stored, stored_as_documented
from torch import nn

import mixedopt

NEW = [name for name in EVERY_OPTIMIZER if name not in OPTIMIZERS]


def twin_mlps(bias=True):
    """Two MLPs with the same weights (without biases: Muon takes matrices only)."""
    torch.manual_seed(0)
    model, reference = (
        nn.Sequential(nn.Linear(8, 16, bias=bias), nn.Tanh(), nn.Linear(16, 4, bias=bias))
        for _ in range(2)
    )
    reference.load_state_dict(model.state_dict())
    return model, reference


def train_both(opt, ref, model, reference, steps=3, scheduler=None):
    """Backward of the same batches on both; the reference fed its gradients rounded as stored."""
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 8, generator=generator)
        for net in (model, reference):
            with torch.autocast("cpu", dtype=torch.float16):
                loss = net(x).float().square().mean()
            loss.backward()
        round_gradients_as_stored(reference.parameters())
        assert all(p.grad.dtype == torch.float16 for p in model.parameters())
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
        if scheduler is not None:
            for s in scheduler:
                s.step()
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)
        for key, value in ref.state[q].items():
            assert opt.state[p][key].dtype == value.dtype
            assert_close_to_float32_noise(opt.state[p][key], value)


# A configuration other than the defaults, for each.
NON_DEFAULT = {
    "ASGD": dict(lr=0.05, lambd=1e-2, alpha=0.5, t0=1.0, weight_decay=1e-2, maximize=True),
    "Adafactor": dict(lr=0.05, beta2_decay=-0.5, eps=(1e-30, 1e-2), d=2.0, weight_decay=1e-2),
    "Muon": dict(lr=0.01, momentum=0.9, nesterov=False, ns_steps=3, adjust_lr_fn="original"),
    "Adadelta": dict(lr=0.5, rho=0.8, eps=1e-4, weight_decay=1e-2, foreach=True),
    "Adagrad": dict(lr=0.05, lr_decay=1e-2, initial_accumulator_value=0.1, weight_decay=1e-2),
    "Adamax": dict(lr=0.01, betas=(0.8, 0.99), weight_decay=1e-2, maximize=True),
    "NAdam": dict(lr=0.01, momentum_decay=0.1, weight_decay=1e-2, decoupled_weight_decay=True),
    "RAdam": dict(lr=0.01, betas=(0.8, 0.99), weight_decay=1e-2, decoupled_weight_decay=True),
    "Rprop": dict(lr=0.003, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0), foreach=False),
}


@pytest.mark.parametrize("configuration", ["defaults", "non-default"])
@pytest.mark.parametrize("name", NEW)
def test_a_model_under_autocast_steps_as_torch_optim_with_float32_state(name, configuration):
    model, reference = twin_mlps(bias=name != "Muon")
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    kwargs = NON_DEFAULT[name] if configuration == "non-default" else {}
    opt, ref = mixed_cls(model.parameters(), **kwargs), torch_cls(reference.parameters(), **kwargs)
    train_both(opt, ref, model, reference, steps=4)


def test_adagrad_creates_its_state_at_construction_as_torch_does():
    model, reference = twin_mlps()
    opt = mixedopt.Adagrad(model.parameters(), initial_accumulator_value=0.5)
    ref = torch.optim.Adagrad(reference.parameters(), initial_accumulator_value=0.5)
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert opt.state[p].keys() == ref.state[q].keys() == {"step", "sum"}
        assert torch.equal(opt.state[p]["sum"], ref.state[q]["sum"])


def test_adagrad_fused_takes_torchs_fused_update():
    model, reference = twin_mlps()
    opt = mixedopt.Adagrad(model.parameters(), lr=0.1, fused=True)
    ref = torch.optim.Adagrad(reference.parameters(), lr=0.1, fused=True)
    train_both(opt, ref, model, reference)


def test_rprop_starts_every_step_size_at_the_learning_rate():
    model, reference = twin_mlps()
    opt = mixedopt.Rprop(model.parameters(), lr=0.003, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0))
    ref = torch.optim.Rprop(
        reference.parameters(), lr=0.003, etas=(0.4, 1.3), step_sizes=(1e-5, 1.0)
    )
    train_both(opt, ref, model, reference, steps=4)


@pytest.mark.parametrize("name", ["Adamax", "NAdam", "RAdam", "Muon"])
def test_cyclic_lr_cycles_the_momentum_or_betas_as_with_torch_optim(name):
    model, reference = twin_mlps(bias=name != "Muon")
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    opt, ref = mixed_cls(model.parameters()), torch_cls(reference.parameters())
    schedulers = [
        torch.optim.lr_scheduler.CyclicLR(o, 1e-3, 1e-2, step_size_up=2, cycle_momentum=True)
        for o in (opt, ref)
    ]
    train_both(opt, ref, model, reference, steps=4, scheduler=schedulers)
    key = "momentum" if name == "Muon" else "betas"
    assert opt.param_groups[0][key] == ref.param_groups[0][key]


@pytest.mark.parametrize("name", [n for n in NEW if n != "Adagrad"])
def test_fused_is_refused_as_torch_optim_refuses_it(name):
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    params = [nn.Parameter(torch.zeros(2))]
    with pytest.raises(TypeError, match="fused"):
        torch_cls(params, fused=True)
    with pytest.raises(TypeError, match="fused"):
        mixed_cls(params, fused=True)


@pytest.mark.parametrize("name", ["NAdam", "ASGD"])
def test_a_parameter_cut_into_pieces_advances_its_scalar_state_once(name):
    """NAdam's mu_product, ASGD's eta and mu: 0-dim, of the whole parameter."""
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    initial = torch.randn(50)
    param, reference = nn.Parameter(initial.clone()), nn.Parameter(initial.clone())
    kwargs = {"t0": 1.0} if name == "ASGD" else {}  # ASGD averages from the first step
    opt, ref = mixed_cls([param], **kwargs), torch_cls([reference], **kwargs)
    with slice_elements(7):  # 8 pieces
        for _ in range(3):
            g = torch.randn(50)
            (param * g).sum().backward()
            reference.grad = stored_as_documented(g)
            opt.step()
            ref.step()
            opt.zero_grad()
    for key, value in ref.state[reference].items():
        if value.dim() == 0:
            assert torch.equal(opt.state[param][key], value), key
        else:
            assert_close_to_float32_noise(opt.state[param][key], value)
    assert_close_to_float32_noise(param, reference)


def test_muon_refuses_what_is_not_a_matrix_with_torchs_error_and_lets_the_parameter_go():
    bias = nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError) as theirs:
        torch.optim.Muon([bias])
    with pytest.raises(ValueError) as mine:
        mixedopt.Muon([bias])
    assert str(mine.value) == str(theirs.value)
    (bias * 2.0).sum().backward()
    assert bias.grad.dtype == torch.float32  # no storage left installed

"""step(): skipping, GradScaler, closures, schedulers, state dtype."""

from __future__ import annotations

import io
import warnings

import pytest
import torch
from helpers import (
    OPTIMIZERS,
    assert_close_to_float32_noise,
    autocast_backward,
    small_model,
    step_both_on_the_same_gradients,
    twin,
)
from parity import round_gradients_as_stored, stored_as_documented
from torch import nn

import mixedopt
import mixedopt._budget


def snapshot(opt, params):
    weights = [p.detach().clone() for p in params]
    state = {
        id(p): {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
        for p in params
    }
    return weights, state


def assert_unchanged(opt, params, before):
    weights, state = before
    for p, w in zip(params, weights, strict=True):
        assert torch.equal(p.detach(), w)
        for key, value in state[id(p)].items():
            assert torch.equal(opt.state[p][key], value), key


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_non_finite_gradient_skips_whole_step_with_warning(name, bad):
    model = small_model()
    params = list(model.parameters())
    opt = (
        OPTIMIZERS[name][0](params, momentum=0.9) if name == "SGD" else OPTIMIZERS[name][0](params)
    )
    autocast_backward(model, torch.randn(4, 6))
    opt.step()  # state exists
    opt.zero_grad()
    autocast_backward(model, torch.randn(4, 6))
    params[0].grad[0, 0] = bad
    before = snapshot(opt, params)
    with warnings.catch_warnings():
        # The bad value is written into .grad in place, which mixedopt rightly reports too
        # (for inf): that is how this test makes it, not what it is about.
        warnings.filterwarnings(
            "ignore", message=r".*\.grad .* changed in place", category=UserWarning
        )
        with pytest.warns(RuntimeWarning, match="inf or NaN; the step was skipped"):
            opt.step()
    assert_unchanged(opt, params, before)
    assert opt.skipped_steps == 1


def test_non_finite_gradient_on_first_step_creates_no_state():
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.Adam([p])
    p.grad = torch.tensor([1.0, float("inf"), 0.0], dtype=torch.float16)
    with pytest.warns(RuntimeWarning):
        opt.step()
    assert len(opt.state[p]) == 0
    assert_close_to_float32_noise(p.detach(), torch.ones(3))


def test_a_finite_step_after_a_skipped_one_proceeds():
    p = nn.Parameter(torch.ones(3))
    opt = mixedopt.SGD([p], lr=1.0)
    p.grad = torch.tensor([float("nan"), 0.0, 0.0], dtype=torch.float16)
    with pytest.warns(RuntimeWarning):
        opt.step()
    p.grad = torch.tensor([1.0, 1.0, 1.0], dtype=torch.float16)
    opt.step()
    assert_close_to_float32_noise(p.detach(), torch.zeros(3))
    assert opt.skipped_steps == 1


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_grad_scaler_found_inf_changes_nothing(name):
    model = small_model()
    params = list(model.parameters())
    opt = OPTIMIZERS[name][0](params)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 6)).float().sum()
    scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 6)).float().sum() * float("inf")
    scaler.scale(loss).backward()
    before = snapshot(opt, params)
    scale_before = scaler.get_scale()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # GradScaler's skip is expected: no warning
        scaler.step(opt)
    scaler.update()
    assert_unchanged(opt, params, before)
    assert scaler.get_scale() < scale_before
    assert not hasattr(opt, "found_inf")  # GradScaler removed its attributes after the step


def test_grad_scaler_unscale_is_refused_for_float16_gradients():
    """GradScaler.unscale_ refuses fp16 gradients itself; max_grad_norm replaces it."""
    model = small_model()
    opt = mixedopt.Adam(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    with torch.autocast("cpu", dtype=torch.float16):
        loss = model(torch.randn(4, 6)).float().sum()
    scaler.scale(loss).backward()
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_closure_is_evaluated_with_grad_and_its_loss_returned(name):
    model = small_model()
    ref_model = twin(model)
    opt = OPTIMIZERS[name][0](model.parameters(), lr=0.01)
    ref = OPTIMIZERS[name][1](ref_model.parameters(), lr=0.01)
    x = torch.randn(4, 6)

    def closure():
        opt.zero_grad()
        return autocast_backward(model, x)

    loss = opt.step(closure)
    assert torch.is_tensor(loss)
    autocast_backward(ref_model, x)
    round_gradients_as_stored(ref_model.parameters())
    ref.step()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


SCHEDULERS = {
    "StepLR": lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    "OneCycleLR": lambda opt: torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=0.01, total_steps=10, cycle_momentum=True
    ),
    "CosineAnnealingLR": lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=5),
    "SequentialLR": lambda opt: torch.optim.lr_scheduler.SequentialLR(
        opt,
        [
            torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=2),
            torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9),
        ],
        milestones=[2],
    ),
    "ReduceLROnPlateau": lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0),
}


@pytest.mark.parametrize("scheduler", SCHEDULERS)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_lr_schedulers_work_unchanged_and_without_warnings(name, scheduler):
    model = small_model()
    ref_model = twin(model)
    kwargs = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = OPTIMIZERS[name][0](model.parameters(), lr=0.01, **kwargs)
        ref = OPTIMIZERS[name][1](ref_model.parameters(), lr=0.01, **kwargs)
        sched, ref_sched = SCHEDULERS[scheduler](opt), SCHEDULERS[scheduler](ref)
        for i in range(6):
            x = torch.randn(4, 6)
            loss = autocast_backward(model, x)
            autocast_backward(ref_model, x)
            round_gradients_as_stored(ref_model.parameters())
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
            args = (float(i % 2),) if scheduler == "ReduceLROnPlateau" else ()
            sched.step(*args)
            ref_sched.step(*args)
            assert opt.param_groups[0]["lr"] == ref.param_groups[0]["lr"]
    assert loss.isfinite()
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        assert_close_to_float32_noise(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_stays_float32_after_loading_lower_precision_state(name):
    model = small_model()
    kwargs = {"momentum": 0.9} if name == "SGD" else {}
    opt = OPTIMIZERS[name][0](model.parameters(), **kwargs)
    autocast_backward(model, torch.randn(4, 6))
    opt.step()
    saved = opt.state_dict()
    for state in saved["state"].values():
        for key, value in state.items():
            if key != "step":
                state[key] = value.half()
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    fresh = OPTIMIZERS[name][0](small_model().parameters(), **kwargs)
    fresh.load_state_dict(torch.load(buffer, weights_only=True))
    for state in fresh.state.values():
        for key, value in state.items():
            assert value.dtype == torch.float32, key


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_state_dict_keys_are_the_parents(name):
    model = small_model()
    ref_model = twin(model)
    opt = OPTIMIZERS[name][0](model.parameters())
    ref = OPTIMIZERS[name][1](ref_model.parameters())
    autocast_backward(model, torch.randn(4, 6))
    autocast_backward(ref_model, torch.randn(4, 6))
    opt.step()
    ref.step()
    mine, theirs = opt.state_dict(), ref.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    assert mine["state"].keys() == theirs["state"].keys()
    for index, state in theirs["state"].items():
        assert mine["state"][index].keys() == state.keys()


def test_sparse_gradient_is_refused_at_step():
    embedding = nn.Embedding(10, 3, sparse=True)
    opt = mixedopt.SGD(embedding.parameters(), lr=0.1)
    embedding(torch.tensor([1, 2])).sum().backward()
    assert embedding.weight.grad.is_sparse
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_step_without_any_gradient_does_nothing():
    model = small_model()
    opt = mixedopt.Adam(model.parameters(), max_grad_norm=1.0)
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    assert opt.last_grad_norm is None


def test_last_grad_norm_is_the_true_total_norm():
    p = nn.Parameter(torch.zeros(2))
    q = nn.Parameter(torch.zeros(1))
    opt = mixedopt.SGD([{"params": [p]}, {"params": [q], "lr": 0.5}], lr=0.1, max_grad_norm=1.0)
    ((p * torch.tensor([3e-7, 0.0])).sum() + (q * 4e-7).sum()).backward()  # 5e-7 in all
    opt.step()
    stored = [
        stored_as_documented(torch.tensor([3e-7, 0.0])),
        stored_as_documented(torch.tensor([4e-7])),
    ]
    assert_close_to_float32_noise(opt.last_grad_norm, torch.linalg.vector_norm(torch.cat(stored)))


def test_last_grad_norm_is_not_computed_without_max_grad_norm():
    p = nn.Parameter(torch.zeros(2))
    opt = mixedopt.SGD([p], lr=0.1)
    p.sum().backward()
    opt.step()
    assert opt.last_grad_norm is None


def test_several_param_groups_keep_their_own_hyperparameters():
    a, b = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(2))
    opt = mixedopt.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    (a + b).sum().backward()
    opt.step()
    assert_close_to_float32_noise(a.detach(), torch.full((2,), 0.9))
    assert_close_to_float32_noise(b.detach(), torch.full((2,), 0.5))


@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_tensor_learning_rate_steps_as_torch_optim_on_the_default_path(name, shape):
    """PyTorch's test_tensor_lr: small tensors on a CPU take foreach by default in mixedopt,
    which torch's Adam refuses with a tensor lr; torch's own choice, the for-loop, is kept."""
    torch.manual_seed(0)
    data = [torch.randn(10, 5), torch.randn(10)]
    params, reference = (
        [nn.Parameter(d.clone()) for d in data],
        [nn.Parameter(d.clone()) for d in data],
    )
    opt = OPTIMIZERS[name][0](params, lr=torch.tensor(1e-3).reshape(shape), fused=False)
    ref = OPTIMIZERS[name][1](reference, lr=torch.tensor(1e-3).reshape(shape))
    step_both_on_the_same_gradients(opt, ref, params, reference)
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_is_a_subclass_of_the_torch_optimizer(name):
    mixed_cls, torch_cls = OPTIMIZERS[name]
    assert issubclass(mixed_cls, torch_cls)
    assert isinstance(mixed_cls(small_model().parameters()), torch.optim.Optimizer)


def test_named_parameters_are_accepted():
    model = small_model()
    opt = mixedopt.AdamW(model.named_parameters())
    assert opt.param_groups[0]["param_names"] == [n for n, _ in model.named_parameters()]
    autocast_backward(model, torch.randn(4, 6))
    opt.step()


def test_positional_arguments_have_the_parents_meaning():
    model = small_model()
    opt = mixedopt.RMSprop(model.parameters(), 0.05, 0.9, 1e-6, 0.01, 0.5, True)
    group = opt.param_groups[0]
    assert (group["lr"], group["alpha"], group["eps"]) == (0.05, 0.9, 1e-6)
    assert (group["weight_decay"], group["momentum"], group["centered"]) == (0.01, 0.5, True)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_deep_copy_keeps_its_settings_and_stores_its_own_gradients(name):
    import copy

    model = small_model()
    opt = OPTIMIZERS[name][0](model.parameters(), max_grad_norm=1.0, grad_dtype=torch.bfloat16)
    autocast_backward(model, torch.randn(4, 6))
    opt.step()
    clone = copy.deepcopy(opt)
    assert (clone.grad_dtype, clone.max_grad_norm) == (torch.bfloat16, 1.0)
    params = clone.param_groups[0]["params"]
    assert all(p is not q for p, q in zip(params, model.parameters(), strict=True))
    for p in params:
        p.grad = None
        (p * 3.0).sum().backward()
        assert p.grad.dtype == torch.bfloat16
    clone.step()
    assert clone.state_dict()["state"].keys() == opt.state_dict()["state"].keys()


@pytest.mark.parametrize("fused", [False, True])
def test_torch_compile_of_step_runs_it_eagerly_with_the_same_weights(fused):
    """PyTorch's recipe for a compiled optimizer, ``torch.compile(optimizer.step)``."""
    model = small_model()
    eager_model = twin(model)
    opt = mixedopt.AdamW(model.parameters(), lr=0.01, fused=fused)
    eager = mixedopt.AdamW(eager_model.parameters(), lr=0.01, fused=fused)
    compiled_step = torch.compile(opt.step)
    x = torch.randn(4, 6)
    for _ in range(3):
        autocast_backward(model, x)
        autocast_backward(eager_model, x)
        compiled_step()
        eager.step()
        opt.zero_grad()
        eager.zero_grad()
    for p, q in zip(model.parameters(), eager_model.parameters(), strict=True):
        assert torch.equal(p, q)


def test_torch_compile_of_step_with_fullgraph_refuses_pointing_to_fused():
    model = small_model()
    opt = mixedopt.AdamW(model.parameters())
    autocast_backward(model, torch.randn(4, 6))
    with pytest.raises(Exception, match="use fused=True for a compiled step"):
        torch.compile(opt.step, fullgraph=True)()


@pytest.mark.parametrize(
    "shape,layout",
    [((1000,), None), ((31, 17), None), ((17, 31), "transposed"), ((2, 3, 5, 7), "channels_last")],
)
@pytest.mark.parametrize("grad_dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_one_gradient_is_upcast_as_the_rows_of_a_batch_are(shape, layout, grad_dtype):
    from mixedopt._default_step import Batch, _upcast_one, _upcast_rows
    from mixedopt._workspace import Workspace

    torch.manual_seed(0)
    param = torch.randn(shape)
    if layout == "transposed":
        param = param.t().contiguous().t()
    elif layout == "channels_last":
        param = param.contiguous(memory_format=torch.channels_last)
    grad = (torch.randn(shape) * 1e3).to(grad_dtype)
    factors = torch.tensor([3.0e-4])  # not a power of two: the rounding of the product shows
    batch = Batch(0, 0)
    batch.add(param, grad, [], {}, None)

    fast = _upcast_one(Workspace(), param, grad, factors[0])
    (reference,) = _upcast_rows(Workspace(), batch, factors)
    assert fast.dtype == torch.float32 and fast.stride() == param.stride()
    assert torch.equal(fast, reference)
    assert torch.equal(fast, grad.float() * factors[0])


@pytest.mark.parametrize("name", ["SGD", "Adam"])
def test_a_large_parameter_whose_gradient_has_another_layout_steps_as_torch_does(name, monkeypatch):
    # Larger than a batch, so that step() would cut it, but its gradient is not in its layout:
    # it is updated whole.
    monkeypatch.setattr(mixedopt._budget, "CPU_CAPACITY", 64)
    torch.manual_seed(0)
    weight = torch.randn(24, 16)
    kwargs = {"lr": 0.1, "momentum": 0.9} if name == "SGD" else {"lr": 0.1}
    mine = nn.Parameter(weight.clone())
    theirs = nn.Parameter(weight.clone())
    opt = getattr(mixedopt, name)([mine], **kwargs)
    reference = getattr(torch.optim, name)([theirs], foreach=False, **kwargs)
    for _ in range(2):
        grad = torch.randn(16, 24).t()  # column-major, the weight row-major
        mine.grad, theirs.grad = grad.clone().t().contiguous().t(), grad.clone()
        assert not mine.grad.is_contiguous()
        opt.step()
        reference.step()
    assert torch.equal(mine, theirs)


@pytest.mark.parametrize("max_grad_norm", [None, 1e9])
def test_gradients_of_true_values_are_upcast_with_no_multiplication(max_grad_norm):
    """bfloat16 gradients hold true values: with no loss scale and no clipping each factor is
    exactly 1. Plain SGD multiplies nothing itself, so an in-place multiplication in its step
    is an upcast gradient's. Its weights are torch.optim's, bit for bit, either way."""
    from mixedopt.bench.bytes import ByteCounter

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(300, 256)), nn.Parameter(torch.randn(64))]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    opt = mixedopt.SGD(params, lr=0.1, grad_dtype=torch.bfloat16, max_grad_norm=max_grad_norm)
    ref = torch.optim.SGD(reference, lr=0.1, foreach=False)
    for p, q in zip(params, reference, strict=True):
        p.grad = torch.randn(p.shape).to(torch.bfloat16)  # true values, as by hand
        q.grad = p.grad.float()
    with ByteCounter(cpu=True) as counter:
        opt.step()
    ref.step()
    multiplied = "mul_" in counter.bytes_by_name
    assert multiplied == (max_grad_norm is not None)  # clipping's factor is not known to be 1
    for p, q in zip(params, reference, strict=True):
        assert torch.equal(p, q)

"""fused=True: the compiled one-pass step, checked against the default path (its reference)."""

from __future__ import annotations

import copy
import math
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import (
    OPTIMIZERS,
    Twins,
    assert_close_to_float32_noise,
    packing,
    scenarios,
    step_both_on_the_same_gradients,
)
from hypothesis import given
from hypothesis import strategies as st
from parity import round_gradients_as_stored, stored_as_documented
from torch import nn

import mixedopt
import mixedopt._budget

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Twins.assert_equal() reads the largest magnitude of a reference parameter: on
# the tensor itself, torch would warn that it converts a tensor that requires grad (once per
# process, so the first test here to do it would fail).
pytestmark = pytest.mark.filterwarnings(
    "error:Converting a tensor with requires_grad=True to a scalar:UserWarning"
)


MOMENTUM = {"SGD": {"momentum": 0.9}}  # SGD keeps a state (its momentum buffer) only with it


def unfused(name):
    """The reference: the same mixedopt optimizer on its default path."""
    return lambda params, **kwargs: OPTIMIZERS[name][0](params, **kwargs)


def fused_and_default(name, data, **kwargs):
    """Parameters holding ``data`` under fused=True, and copies of them on the default path."""
    params = [nn.Parameter(d.clone()) for d in data]
    reference = [nn.Parameter(d.clone()) for d in data]
    cls = OPTIMIZERS[name][0]
    return params, reference, cls(params, fused=True, **kwargs), cls(reference, **kwargs)


def graphs_compiled():
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def step_on_random_gradients(opt, params):
    """A backward with a random gradient for each of ``params``, a step and ``zero_grad()``."""
    for p in params:
        (p * torch.randn(p.shape)).sum().backward()
    opt.step()
    opt.zero_grad()


@given(scenarios(), st.sampled_from([None, 0.5]), st.booleans())
def test_fused_step_matches_the_default_path(s, max_grad_norm, inject_nan):
    s["kwargs"]["foreach"] = None  # fused and foreach exclude each other, as in torch.optim
    twins = Twins(
        s["name"],
        s["kwargs"],
        s["shapes"],
        s["seed"],
        reference=unfused(s["name"]),
        fused=True,
        max_grad_norm=max_grad_norm,
    )
    twins.ref.max_grad_norm = max_grad_norm
    for step in range(s["steps"] + 1):  # the first step runs the default path
        twins.backward(s["magnitudes"][step % len(s["magnitudes"])])
        if inject_nan and step == s["steps"] and twins.params[0].numel() > 0:
            twins.params[0].grad.view(-1)[0] = float("nan")
            twins.ref_params[0].grad.view(-1)[0] = float("nan")
        # An accelerator's budget: the kernels decide the skip on the device.
        with warnings.catch_warnings(), packing(s["packing"]):
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            twins.opt.step()
            twins.ref.step()
        twins.assert_equal(ulps=8)
        assert twins.opt.skipped_steps == twins.ref.skipped_steps
        twins.zero_grad()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_changing_the_learning_rate_or_stepping_does_not_recompile(name):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (3, 40, 1000)]
    opt = OPTIMIZERS[name][0](params, lr=0.1, fused=True)
    schedule = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(8):
        if step == 2:  # state exists and the first fused step has compiled
            compiled = graphs_compiled()
        step_on_random_gradients(opt, params)
        schedule.step()
    assert graphs_compiled() == compiled


def test_one_compilation_serves_parameters_of_every_rank_and_size():
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(shape)) for shape in [(5,), (6, 7), (2, 3, 4), (2, 2, 3, 3)]]
    opt = mixedopt.RMSprop(params, fused=True)
    for _ in range(3):
        for p in params:
            (p * torch.randn(p.shape)).sum().backward()
        before = graphs_compiled()
        opt.step()
        opt.zero_grad()
    assert graphs_compiled() - before == 0
    assert graphs_compiled() >= 1


# Parameters of many shapes and sizes: empty, single-element and (in the test) one in
# column-major layout among them.
MANY_SHAPES = [(7,), (3, 5), (64,), (2, 3, 4), (0,), (), (1,), (33,), (8, 8), (5,), (16,)] + [
    (n,) for n in range(2, 12)
]
OPTIONS = {
    "RMSprop": dict(momentum=0.9, centered=True, weight_decay=0.01),
    "Adam": dict(amsgrad=True, weight_decay=0.01, maximize=True),
    "AdamW": dict(amsgrad=True, weight_decay=0.01),
    "SGD": dict(momentum=0.9, nesterov=True, weight_decay=0.01),
}


@pytest.fixture
def small_packs(monkeypatch):
    """Packs of at most 256 elements, and parameters of more than 20 elements updated alone."""
    monkeypatch.setattr(mixedopt._budget, "CPU_CAPACITY", 256)
    monkeypatch.setattr(mixedopt._budget, "CPU_SMALL", 20)


@pytest.mark.parametrize("options", ["defaults", "options"])
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_packs_and_single_parameters_match_the_default_path(name, options, small_packs):
    kwargs = dict(lr=0.01, **(OPTIONS[name] if options == "options" else {}))
    twins = Twins(name, kwargs, MANY_SHAPES, seed=1, reference=unfused(name), fused=True)
    for p in (twins.params[1], twins.ref_params[1]):
        p.data = p.data.t().contiguous().t()  # same values, column-major
    assert not twins.params[1].is_contiguous()
    for magnitude in (-3, 0, -7, 2):
        twins.backward(magnitude)
        twins.opt.step()
        twins.ref.step()
        twins.assert_equal(ulps=8)
        twins.zero_grad()


def compiled_calls(opt, monkeypatch):
    """Record the compiled calls of the optimizer's fused steps from now on.

    A call on one pack or parameter records its shape; a call on a list of large parameters
    records their sizes.
    """
    calls = []
    run, run_each = mixedopt._compiled.run, mixedopt._compiled.run_each

    def counting(kernel, arguments):
        calls.append(arguments[0].shape)
        return run(kernel, arguments)

    def counting_each(kernel, parameters, *rest):
        calls.append([tensors[0].numel() for tensors in parameters])
        return run_each(kernel, parameters, *rest)

    monkeypatch.setattr(mixedopt._fused_step._compiled, "run", counting)
    monkeypatch.setattr(mixedopt._fused_step._compiled, "run_each", counting_each)
    return calls


def test_small_rmsprop_parameters_are_updated_in_one_compiled_call(monkeypatch):
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(32)])  # 64 parameters
    opt = mixedopt.RMSprop(model.parameters(), lr=0.01, fused=True)
    x = torch.randn(4, 16)
    for step in range(3):
        if step == 2:
            calls = compiled_calls(opt, monkeypatch)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    assert len(calls) == 1
    assert len(calls[0]) == 2  # one pack: rows x ROW


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_small_parameters_take_torchs_fused_update_where_the_parent_has_one(name, monkeypatch):
    """No compiled call: the same result as torch.optim's fused update fed float32 gradients."""
    mixed_cls, torch_cls = OPTIMIZERS[name]
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)])
    reference = copy.deepcopy(model)
    kwargs = dict(lr=0.01, weight_decay=0.01, **({"momentum": 0.9} if name == "SGD" else {}))
    opt = mixed_cls(model.parameters(), fused=True, **kwargs)
    ref = torch_cls(reference.parameters(), fused=True, **kwargs)
    calls = compiled_calls(opt, monkeypatch)
    for _ in range(3):
        x = torch.randn(4, 16)
        model(x).square().mean().backward()
        reference(x).square().mean().backward()
        round_gradients_as_stored(reference.parameters())
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert calls == []
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q)
        for key, value in ref.state[q].items():
            assert torch.equal(opt.state[p][key], value)


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD"])
def test_fused_step_of_a_parameter_with_gaps_writes_only_its_own_elements(name):
    """torch's fused kernels would walk its memory as if it were contiguous (torch 2.13)."""
    mixed_cls, torch_cls = OPTIMIZERS[name]
    kwargs = dict(lr=0.01, weight_decay=0.01, **({"momentum": 0.9} if name == "SGD" else {}))
    torch.manual_seed(0)
    memory = torch.zeros(4, 24)
    param = nn.Parameter(memory[:, ::2])  # every other column of memory
    with torch.no_grad():
        param.copy_(torch.randn(4, 12))
    reference = nn.Parameter(param.detach().clone())
    opt = mixed_cls([param], fused=True, **kwargs)
    ref = torch_cls([reference], foreach=False, **kwargs)
    for _ in range(3):  # the first step on the default path, then fused ones
        g = torch.randn(4, 12)
        (param * g).sum().backward()
        reference.grad = stored_as_documented(g)
        opt.step()
        ref.step()
        opt.zero_grad()
    assert torch.equal(memory[:, 1::2], torch.zeros(4, 12))
    assert_close_to_float32_noise(param, reference)
    for key, value in ref.state[reference].items():
        assert_close_to_float32_noise(opt.state[param][key], value)


def test_compiled_calls_of_a_group_are_bounded_by_its_bytes(monkeypatch, small_packs):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in [10] * 40 + [100, 300]]
    opt = mixedopt.RMSprop(params, fused=True)
    for step in range(3):
        if step == 2:
            calls = compiled_calls(opt, monkeypatch)
        step_on_random_gradients(opt, params)
    # 40 parameters of one row each in packs of 256 // 64 = 4 rows, and the 2 large parameters
    # in one call, padded to PARAMETERS_PER_CALL with scratch ones of 2 elements.
    padding = [2] * (mixedopt._compiled.PARAMETERS_PER_CALL - 2)
    assert calls == [torch.Size([4, 64])] * 10 + [[100, 300, *padding]]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_large_parameters_share_compiled_calls_and_match_the_default_path(
    name, monkeypatch, small_packs
):
    """Dense ones by PARAMETERS_PER_CALL (the last call padded); one not dense on its own."""
    kwargs = dict(lr=0.01, **OPTIONS[name])
    per_call = mixedopt._compiled.PARAMETERS_PER_CALL
    # One call's worth of dense parameters and one more (sizes 30, 31, ...), one of them
    # column-major, then one that is not dense.
    dense = [(30 + i,) for i in range(per_call + 1)]
    dense[1] = (5, 8)
    shapes = [*dense, (4, 12)]
    twins = Twins(name, kwargs, shapes, seed=2, reference=unfused(name), fused=True)
    for p in (twins.params[1], twins.ref_params[1]):
        p.data = p.data.t().contiguous().t()  # dense, column-major
    for p in (twins.params[-1], twins.ref_params[-1]):
        p.data = torch.zeros(4, 24)[:, ::2].copy_(p.data)  # not dense
    for step, magnitude in enumerate((-3, 0, -7, 2)):
        if step == 2:  # the first fused step (the second) has compiled
            calls = compiled_calls(twins.opt, monkeypatch)
        twins.backward(magnitude)
        twins.opt.step()
        twins.ref.step()
        twins.assert_equal(ulps=8)
        twins.zero_grad()
    sizes = [math.prod(shape) for shape in dense]
    padding = [2] * (per_call - 1)  # scratch parameters of 2 elements
    one_step = [torch.Size([4, 12]), sizes[:per_call], [sizes[per_call], *padding]]
    assert calls == one_step * 2


def test_the_number_of_compiled_graphs_does_not_grow_with_the_number_of_parameters():
    torch._dynamo.reset()
    counts = []
    for layers in (2, 40):
        model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(layers)])
        opt = mixedopt.RMSprop(model.parameters(), fused=True)
        before = graphs_compiled()
        for _ in range(3):
            model(torch.randn(2, 8)).square().mean().backward()
            opt.step()
            opt.zero_grad()
        counts.append(graphs_compiled() - before)
    assert counts[1] == 0  # the layout compiled for 4 parameters serves 80


def test_large_gradients_inside_a_larger_buffer_or_of_their_own_share_one_compiled_graph(
    small_packs,
):
    """Gradients that start their memory or not (rows of a bucket) take one compiled layout.

    Dynamic shapes specialise a storage offset of 0: without aliases that start at offset 0,
    each mix of the two in one call would compile again.
    """
    params = [nn.Parameter(torch.randn(30)) for _ in range(3)]
    opt = mixedopt.SGD(params, lr=0.01, fused=True)
    counts = []
    # Which parameter's gradient is a view of a larger buffer (of another rank each time),
    # the others having tensors of their own; None: no view.
    for viewed, shape in [(0, (100,)), (1, (10, 10)), (None, ()), (2, (2, 5, 10))]:
        before = graphs_compiled()
        for i, p in enumerate(params):
            if i == viewed:
                p.grad = torch.randn(shape).half().view(-1)[10:40]
            else:
                p.grad = torch.randn(30).half()
        opt.step()
        counts.append(graphs_compiled() - before)
    assert counts[1:] == [0, 0, 0]


def test_flat_alias_starts_at_offset_0_and_falls_back_to_the_offset_where_dlpack_refuses(
    monkeypatch,
):
    backing = torch.zeros(100)
    view = backing[10:40]
    alias = mixedopt._compiled.flat_alias(view)
    assert (alias.storage_offset(), alias.data_ptr()) == (0, view.data_ptr())
    assert mixedopt._compiled.flat_alias(backing) is backing  # such a tensor already
    param = nn.Parameter(torch.zeros(10))
    assert mixedopt._compiled.flat_alias(param) is not param  # compiled code sees no parameter

    def refused(tensor):
        raise BufferError("no DLPack here")

    monkeypatch.setattr(torch, "from_dlpack", refused)
    alias = mixedopt._compiled.flat_alias(view)
    assert (alias.storage_offset(), alias.data_ptr()) == (10, view.data_ptr())
    alias.fill_(1)  # either way, the alias is the tensor's memory
    assert backing[10:40].eq(1).all() and backing[:10].eq(0).all() and backing[40:].eq(0).all()


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("Adam", dict(betas=(0.0, 0.999))),
        ("Adam", dict(betas=(0.3, 0.999))),
        ("AdamW", dict(betas=(0.5, 0.999))),
        ("RMSprop", dict(alpha=0.3, centered=True)),
        ("RMSprop", dict(alpha=0.5, centered=True)),
    ],
)
def test_fused_running_averages_with_weights_of_a_half_or_more_match_the_default_path(name, kwargs):
    """torch.lerp switches formula at weight 0.5 (1 - beta1, 1 - alpha); so do the kernels."""
    twins = Twins(name, dict(lr=0.01, **kwargs), [(6,), (3, 4)], 4, unfused(name), fused=True)
    for magnitude in (-2, 0, -4):
        twins.backward(magnitude)
        twins.opt.step()
        twins.ref.step()
        twins.assert_equal(ulps=8)
        twins.zero_grad()


def test_a_param_group_added_with_a_known_layout_does_not_recompile(small_packs):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(n)) for n in (10, 12, 40)]
    opt = mixedopt.RMSprop(params, lr=0.1, fused=True)
    for step in range(6):
        if step == 2:
            compiled = graphs_compiled()
        if step == 3:  # other sizes, another learning rate: the same compiled layouts
            added = [nn.Parameter(torch.randn(n)) for n in (7, 19, 33, 50)]
            opt.add_param_group({"params": added, "lr": 0.01})
            params += added
        step_on_random_gradients(opt, params)
    assert graphs_compiled() == compiled


def test_large_parameters_first_seen_with_equal_sizes_take_other_sizes_without_recompiling(
    small_packs,
):
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(40)) for _ in range(2)]  # one compiled call, equal sizes
    opt = mixedopt.RMSprop(params, lr=0.1, fused=True)
    for step in range(5):
        if step == 2:
            compiled = graphs_compiled()
            added = [nn.Parameter(torch.randn(n)) for n in (33, 50)]
            opt.add_param_group({"params": added})
            params += added
        step_on_random_gradients(opt, params)
    assert graphs_compiled() == compiled


def test_packs_of_other_size_patterns_do_not_recompile(small_packs):
    torch.manual_seed(0)
    # A pack of equal sizes, a pack of distinct sizes, and two parameters alone.
    params = [nn.Parameter(torch.randn(n)) for n in [10] * 4 + list(range(11, 15)) + [40, 50]]
    opt = mixedopt.RMSprop(params, fused=True)
    for step in range(4):
        if step == 2:
            compiled = graphs_compiled()
        step_on_random_gradients(opt, params)
    assert graphs_compiled() == compiled


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_follows_a_parameter_moved_to_new_memory(name):
    kwargs = dict(lr=0.01, **OPTIONS[name])
    twins = Twins(name, kwargs, [(6,), (3, 4)], seed=2, reference=unfused(name), fused=True)
    for step in range(4):
        if step == 2:  # replace the weights' memory (and the state's, as load_state_dict does)
            for p in twins.params:
                p.data = p.data.clone()
            twins.opt.load_state_dict(twins.opt.state_dict())
        twins.backward(-2)
        twins.opt.step()
        twins.ref.step()
        twins.assert_equal(ulps=8)
        twins.zero_grad()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_kernels_given_a_skip_flag_keep_weights_and_state_when_it_is_set(name):
    """The accelerator variant (skip decided on the device), run here on the CPU."""
    kwargs = dict(lr=0.01, **OPTIONS[name])
    twins = Twins(name, kwargs, [(6,), (3, 4)], seed=3, reference=unfused(name), fused=True)
    twins.backward(-1)
    twins.opt.step()  # the first step creates the state (on the default path)
    twins.ref.step()
    twins.zero_grad()
    for skip in (False, True, False):
        twins.backward(-1)
        if skip:
            weights = [p.detach().clone() for p in twins.params]
            state = copy.deepcopy(twins.opt.state_dict()["state"])
        group = twins.opt.param_groups[0]
        stages = twins.opt._stages
        entries = stages.reference.entries(group["params"])
        factors, _, _ = stages.reference.factors_and_skip(entries, None, None, None)
        stages.fused.step_group(group, entries, factors, torch.tensor(skip))
        if skip:
            for p, before in zip(twins.params, weights, strict=True):
                assert torch.equal(p.detach(), before)
            for index, values in twins.opt.state_dict()["state"].items():
                for key, value in values.items():
                    assert torch.equal(value, state[index][key])
        else:
            twins.ref.step()
            twins.assert_equal(ulps=8)
        twins.zero_grad()


def test_past_the_recompile_limit_new_layouts_run_uncompiled_with_one_warning(monkeypatch):
    monkeypatch.setattr(mixedopt._compiled, "RECOMPILE_LIMIT", 1)
    monkeypatch.setattr(mixedopt._compiled, "_over_limit", set())
    torch.manual_seed(0)
    data = [torch.randn(n) for n in range(3, 11)]
    params, reference, opt, ref = fused_and_default("RMSprop", data, lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(4):
            for p, q in zip(params, reference, strict=True):
                g = torch.randn(p.shape)
                if step < 2:  # float16, as backward stores it: compiles (at least) this layout
                    (p * g).sum().backward()
                    (q * g).sum().backward()
                else:  # float32, assigned by hand: a layout over the limit
                    p.grad, q.grad = g.clone(), g.clone()
            opt.step()
            ref.step()
            opt.zero_grad()
            ref.zero_grad()
    messages = [str(w.message) for w in caught if "parameter layouts" in str(w.message)]
    assert messages == [
        "mixedopt: fused=True has compiled rmsprop_kernel for 1 parameter layouts; parameters of "
        "other layouts are updated uncompiled"
    ]
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


def test_adam_step_coefficients_read_on_the_host_equal_those_kept_on_the_device():
    """A tensor learning rate takes the path of step counters on an accelerator."""
    counts = [0.0, 1.0, 9.0, 9999.0, 1.0]
    steps = torch.tensor(counts)
    host = mixedopt._compiled.adam_step_coefficients(0.001, 0.9, 0.999, steps)
    device = mixedopt._compiled.adam_step_coefficients(torch.tensor(0.001), 0.9, 0.999, steps)
    assert all(t.dtype == torch.float32 and t.shape == (5,) for t in (*host, *device))
    step_size = [0.001 / (1 - 0.9 ** (n + 1)) for n in counts]
    inverse = [(1 - 0.999 ** (n + 1)) ** -0.5 for n in counts]
    for value, exact in zip(host, (step_size, inverse), strict=True):
        assert torch.equal(value, torch.tensor(exact, dtype=torch.float64).float())
    for value, exact in zip(device, (step_size, inverse), strict=True):
        assert_close_to_float32_noise(value, torch.tensor(exact, dtype=torch.float32))


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_skips_on_inf_with_warning_on_cpu(name):
    p = nn.Parameter(torch.ones(10))
    opt = OPTIMIZERS[name][0]([p], lr=0.1, fused=True)
    for _ in range(2):
        (p * 2.0).sum().backward()
        opt.step()
        opt.zero_grad()
    state = {k: v.clone() for k, v in opt.state[p].items()}
    weights = p.detach().clone()
    (p * float("inf")).sum().backward()
    with pytest.warns(RuntimeWarning, match="the step was skipped"):
        opt.step()
    assert torch.equal(p.detach(), weights)
    for key, value in state.items():
        assert torch.equal(opt.state[p][key], value)
    assert opt.skipped_steps == 1


def test_rmsprop_gains_a_fused_argument_and_keeps_the_parents_groups_without_it():
    p = nn.Parameter(torch.ones(2))
    assert mixedopt.RMSprop([p], fused=True).param_groups[0]["fused"] is True
    q = nn.Parameter(torch.ones(2))
    assert "fused" not in mixedopt.RMSprop([q]).param_groups[0]


def test_rmsprop_refuses_fused_with_foreach_as_torch_optim_does():
    with pytest.raises(RuntimeError, match="`fused` and `foreach` cannot be `True` together"):
        mixedopt.RMSprop([nn.Parameter(torch.ones(2))], fused=True, foreach=True)


def test_fused_state_step_lives_on_the_parameters_device():
    p = nn.Parameter(torch.ones(2))
    opt = mixedopt.Adam([p], fused=True)
    (p * 2).sum().backward()
    opt.step()
    assert opt.state[p]["step"].device == p.device


NO_COMPILER = textwrap.dedent(
    """
    import warnings
    import torch, torch._inductor.config as config
    import mixedopt
    config.cpp.cxx = ("/nonexistent/c++",)
    config.fx_graph_cache = False
    config.autotune_local_cache = False
    params = [torch.nn.Parameter(torch.ones(100)) for _ in range(2)]
    reference = [torch.nn.Parameter(torch.ones(100)) for _ in range(2)]
    opt = mixedopt.RMSprop(params, lr=0.1, fused=True)  # no torch fused update to take over
    ref = mixedopt.RMSprop(reference, lr=0.1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(3):
            for p, q in zip(params, reference):
                p.grad = torch.full((100,), 0.5, dtype=torch.float16)
                q.grad = torch.full((100,), 0.5, dtype=torch.float16)
            opt.step()
            ref.step()
    messages = [str(w.message) for w in caught if "needs torch.compile" in str(w.message)]
    assert len(messages) == 1, messages
    for p, q in zip(params, reference):
        assert torch.equal(p, q)  # the default path it falls back to
    print("fell back")
    """
)


def run_with_an_empty_compile_cache(script, cache_dir):
    """Run ``script`` in a new interpreter whose Inductor cache is ``cache_dir``; its stdout."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_without_a_compiler_fused_falls_back_to_the_default_path_with_one_warning(tmp_path):
    assert "fell back" in run_with_an_empty_compile_cache(NO_COMPILER, tmp_path)


COMPILE_ON_THE_CALLING_THREAD = textwrap.dedent(
    """
    import torch
    from torch._dynamo.utils import counters
    from torch._inductor.async_compile import AsyncCompile
    import mixedopt
    params = [torch.nn.Parameter(torch.ones(100)) for _ in range(2)]
    opt = mixedopt.RMSprop(params, lr=0.1, fused=True)
    for step in range(2):
        for p in params:
            (p * 2.0).sum().backward()
        opt.step()
    print("graphs", counters["stats"]["unique_graphs"])
    print("pool", AsyncCompile.pool.cache_info().currsize)
    """
)


def test_fused_kernels_are_compiled_on_the_calling_thread(tmp_path):
    # Inductor's own thread pool is not started: a compile inside an updating backward hands
    # no work to another thread. An empty cache makes the kernels compile for real.
    stdout = run_with_an_empty_compile_cache(COMPILE_ON_THE_CALLING_THREAD, tmp_path)
    lines = dict(line.split() for line in stdout.splitlines())
    assert int(lines["graphs"]) > 0
    assert lines["pool"] == "0"


@needs_cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_on_cuda_does_not_synchronise_with_the_host(name):
    params = [nn.Parameter(torch.randn(1000, device="cuda")) for _ in range(3)]
    opt = OPTIMIZERS[name][0](params, lr=0.1, fused=True)
    for step in range(3):
        for p in params:
            (p * 2.0).sum().backward()
        if step == 2:
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        opt.zero_grad()


@needs_cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_on_cuda_matches_the_default_path(name):
    torch.manual_seed(0)
    data = [torch.randn(n, device="cuda") for n in (1, 33, 4097)]
    params, reference, opt, ref = fused_and_default(name, data, lr=0.01)
    for _ in range(4):
        for p, q in zip(params, reference, strict=True):
            g = torch.randn(p.shape, device="cuda") * 1e-5
            (p * g).sum().backward()
            (q * g).sum().backward()
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


@needs_cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_on_cuda_of_large_parameters_in_one_bucket_compiles_one_graph(name, monkeypatch):
    """Their gradients are rows of one bucket, at offset 0 and beyond, over two calls.

    On an accelerator backward buckets gradients larger than the kernels' packing limit (here
    100 elements): the two calls of nine parameters see different mixes of offsets, which
    compiled a graph each before the aliases started at offset 0.
    """
    monkeypatch.setattr(mixedopt._budget, "ACCELERATOR_FUSED_SMALL", 100)
    torch._dynamo.reset()
    torch.manual_seed(0)
    data = [torch.randn(n, device="cuda") for n in range(300, 1200, 100)]
    params, reference, opt, ref = fused_and_default(name, data, lr=0.01)
    before = graphs_compiled()
    for _ in range(4):
        grads = [torch.randn(p.shape, device="cuda") * 1e-3 for p in params]
        sum((p * g).sum() for p, g in zip(params, grads, strict=True)).backward()
        sum((q * g).sum() for q, g in zip(reference, grads, strict=True)).backward()
        assert any(p.grad.storage_offset() != 0 for p in params)  # rows of a bucket
        opt.step()
        ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert graphs_compiled() - before == 1
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


@needs_cuda
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_step_of_a_group_on_cpu_and_cuda_matches_the_default_path(name):
    torch.manual_seed(0)
    data = [torch.randn(n, device=d) for n, d in [(40, "cuda"), (30, "cpu"), (20, "cuda")]]
    params, reference, opt, ref = fused_and_default(name, data, lr=0.01)
    for step in range(4):
        for p, q in zip(params, reference, strict=True):
            g = torch.randn(p.shape, device=p.device) * (float("inf") if step == 2 else 1e-3)
            (p * g).sum().backward()
            (q * g).sum().backward()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # the skipped step's warning
            opt.step()
            ref.step()
        opt.zero_grad()
        ref.zero_grad()
    assert opt.skipped_steps == ref.skipped_steps == 1
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_bfloat16_storage_fused_and_default_match_torch_optim(name):
    torch.manual_seed(0)
    data = [torch.randn(n) for n in (5, 300)]
    fused_params = [nn.Parameter(d.clone()) for d in data]
    default_params = [nn.Parameter(d.clone()) for d in data]
    reference = [nn.Parameter(d.clone()) for d in data]
    mixed_cls, torch_cls = OPTIMIZERS[name]
    fused = mixed_cls(fused_params, lr=0.01, grad_dtype=torch.bfloat16, fused=True)
    default = mixed_cls(default_params, lr=0.01, grad_dtype=torch.bfloat16)
    ref = torch_cls(reference, lr=0.01)
    for _ in range(3):
        for p, q, r in zip(fused_params, default_params, reference, strict=True):
            g = torch.randn(p.shape) * 1e-6
            (p * g).sum().backward()
            (q * g).sum().backward()
            assert p.grad.dtype == q.grad.dtype == torch.bfloat16
            r.grad = stored_as_documented(g, torch.bfloat16)
        fused.step()
        default.step()
        ref.step()
        for opt in (fused, default, ref):
            opt.zero_grad()
    for p, q, r in zip(fused_params, default_params, reference, strict=True):
        assert_close_to_float32_noise(q, r)
        assert_close_to_float32_noise(p, r)


@pytest.mark.parametrize("name", OPTIMIZERS)
@pytest.mark.parametrize("shape", [(), (1,), (1, 1)])
def test_fused_takes_a_tensor_learning_rate_of_any_one_element_shape(name, shape):
    """As torch.optim does: the weights of torch.optim with a float lr.

    On torch's fused update and on the compiled kernels.
    """
    torch.manual_seed(0)
    # 10 x 10 takes torch's fused update (or a pack), 200 x 200 a compiled call of its own.
    data = [torch.randn(10, 10), torch.randn(200, 200)]
    momentum = {"momentum": 0.9} if name in ("SGD", "RMSprop") else {}
    lr = torch.full(shape, 0.01)
    params = [nn.Parameter(d.clone()) for d in data]
    reference = [nn.Parameter(d.clone()) for d in data]
    opt = OPTIMIZERS[name][0](params, lr=lr, fused=True, **momentum)
    ref = OPTIMIZERS[name][1](reference, lr=0.01, **momentum)
    step_both_on_the_same_gradients(opt, ref, params, reference)
    for p, q in zip(params, reference, strict=True):
        assert_close_to_float32_noise(p, q)


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_fused_on_a_device_without_fused_kernels_raises_torchs_error_at_the_first_step(name):
    """As torch.optim does (PyTorch's test_fused_error_on_params_on_meta), changing nothing."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 3), nn.Sigmoid(), nn.Linear(3, 1))
    opt = OPTIMIZERS[name][0](model.parameters(), lr=0.1, fused=True)
    with torch.device("meta"):
        for p in model.parameters():
            p.grad = torch.rand_like(p)
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating"):
        opt.step()
    assert not opt.state
    opt.zero_grad(set_to_none=True)
    model.to_empty(device="cpu")  # new parameters, which the optimizer does not hold
    for p in model.parameters():
        p.grad = torch.rand_like(p)
    opt.step()


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_fused_step_refused_for_a_device_checks_again_at_the_next(name):
    """Only the parameters with a gradient are checked, as torch.optim checks them."""
    on_cpu, on_meta = nn.Parameter(torch.ones(4)), nn.Parameter(torch.ones(3, device="meta"))
    opt = OPTIMIZERS[name][0]([on_cpu, on_meta], lr=0.1, fused=True, **MOMENTUM.get(name, {}))
    on_cpu.grad, on_meta.grad = torch.ones(4), torch.ones(3, device="meta")
    with pytest.raises(RuntimeError, match="`fused=True` requires all the params to be floating"):
        opt.step()
    assert_close_to_float32_noise(on_cpu.detach(), torch.ones(4))  # nothing was updated
    on_meta.grad = None
    opt.step()
    assert on_cpu.detach().lt(1).all()

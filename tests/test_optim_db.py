"""Parity with torch.optim on PyTorch's own optimizer test configurations.

What: ``torch.testing._internal.common_optimizers.optim_db`` lists the configurations PyTorch
tests its optimizers with (``optim_inputs_func``: keyword arguments such as ``amsgrad``,
``maximize``, ``nesterov``, a tensor ``lr``), each of which its tests run on every
implementation (``supported_impls``: ``foreach``, ``fused``, ``differentiable``). For every class
mixedopt has, on the CPU, every configuration runs here on each implementation: the for-loop
one (every flag False, as PyTorch's tests build it), ``foreach=True``, ``fused=True`` (mixedopt's
own for RMSprop, whose reference is then torch's default RMSprop), and the default (no flag:
mixedopt chooses foreach for small tensors where torch takes the for-loop). ``mixedopt.X`` and
``torch.optim.X`` with the same keyword arguments step identical float32 parameters. mixedopt's
get their gradients through backward, stored in 16 bits by its hooks; torch.optim's are the
same float32 gradients rounded as docs/grad.md documents the storage to round them
(``parity.stored_as_documented``), of a magnitude that changes every step (1e-6 to 1e5).
Weights and ``state_dict()`` must agree to float32 noise after every step, across a checkpoint
(``torch.save``/``torch.load(weights_only=True)`` of weights and ``state_dict()``) loaded into
fresh parameters and optimizers of both kinds after step 2.

Why: mixedopt claims the parent's update for every argument of the parent; these are the
argument combinations PyTorch itself considers worth testing.

Not run (mixedopt refuses them by documentation, docs/behaviour.md, "Differences from torch.optim"):

- ``differentiable=True`` (an implementation in ``supported_impls``): a ``ValueError`` at
  construction. Generated as skipped tests with that reason.
- ``capturable=True``: a ``ValueError`` at construction. ``optim_inputs_func`` yields these
  (and Adam's tensor betas, which torch accepts only with ``capturable``) for CUDA devices only,
  nothing on the CPU; any that appears is generated as skipped.
- sparse gradients: refused at ``step()``. None of these configurations has any: torch tests
  sparse gradients (SGD's ``supports_sparse``) with inputs of their own.
- parameters that are not float32: a ``ValueError`` at construction. The configurations are
  asked for with ``dtype=torch.float32`` (for float16, torch raises Adam's ``eps``).

Also: torch yields configurations that only run on an accelerator (the ``capturable`` ones above,
Adam's tensor ``lr`` on MPS) only for those devices, so none of the CPU ones is skipped for
needing one. None of them gives parameter groups of its own (``OptimizerInput.params`` is
``None``: the model's parameters); one that did is generated as skipped. ``foreach=True`` is
run although PyTorch's tests leave it out on the CPU (foreach kernels are slow there, not
missing): both libraries run it.

Importing ``common_optimizers`` locks the ``torch.backends`` flags
(``torch.backends.disable_global_flags()``); the lock is undone, so that other tests are not
affected.
"""

from __future__ import annotations

import copy
import inspect
import io
import re

import pytest
import torch
from helpers import EPS32, EVERY_OPTIMIZER, NOISE_ULPS
from parity import stored_as_documented
from torch import nn


def _optim_db():
    frozen = torch.backends.flags_frozen()
    try:
        from torch.testing._internal.common_optimizers import optim_db
    finally:
        if not frozen:  # the module-level flag that disable_global_flags() cleared
            flags = torch.backends.disable_global_flags.__globals__
            flags["__allow_nonbracketed_mutation_flag"] = True
    return {info.optim_cls.__name__: info for info in optim_db}


STEPS = 5
CHECKPOINT_AFTER = 2
IMPLEMENTATIONS = ["for-loop", "foreach", "fused", "default", "differentiable"]
SHAPES = [(3, 5), (3,), (2, 3, 2, 2)]  # a 2-D weight, a 1-D bias, a convolution's weight
MATRICES = [(3, 5), (4, 2)]
MAGNITUDES = [1.0, 1e-6, 1e5, 1e-3, 1e2]  # of the gradients, step by step


def _cases():
    infos = _optim_db()
    for name in EVERY_OPTIMIZER:
        info = infos[name]
        for optim_input in info.optim_inputs_func(device="cpu", dtype=torch.float32):
            for impl in IMPLEMENTATIONS:
                has = inspect.signature(EVERY_OPTIMIZER[name][0]).parameters
                if impl in ("foreach", "fused", "differentiable") and impl not in has:
                    continue  # neither torch.optim's class nor mixedopt's has it
                # As PyTorch's tests build them: the class's flags all False, or one True.
                flags = {flag: False for flag in info.supported_impls}
                flags = {} if impl == "default" else flags if impl == "for-loop" else {impl: True}
                kwargs = {**optim_input.kwargs, **flags}
                # torch.optim.RMSprop has no fused: mixedopt's is compared with its default.
                torch_kwargs = {
                    k: v
                    for k, v in kwargs.items()
                    if k != "fused" or "fused" in info.supported_impls
                }
                refused = [f for f in ("capturable", "differentiable") if kwargs.get(f)]
                marks = []
                if refused:
                    marks = pytest.mark.skip(
                        reason=f"{refused[0]}=True: refused by mixedopt (docs/behaviour.md)"
                    )
                elif optim_input.params is not None:
                    marks = pytest.mark.skip(reason="optim_db gives parameter groups of its own")
                desc = re.sub(r"\W+", "_", optim_input.desc)
                yield pytest.param(
                    name, kwargs, torch_kwargs, marks=marks, id=f"{name}-{desc}-{impl}"
                )


def _parameters(values):
    return [nn.Parameter(v.clone()) for v in values]


def _checkpoint(params, optimizer):
    """Weights and ``state_dict()`` through ``torch.save``/``torch.load(weights_only=True)``."""
    buffer = io.BytesIO()
    torch.save({"weights": [p.detach() for p in params], "optim": optimizer.state_dict()}, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _assert_same(mine, reference, where):
    if isinstance(reference, torch.Tensor):
        if where.endswith("step"):
            assert mine.item() == reference.item(), where  # a step counter, on any device
        else:  # float32 noise: other kernels computing the same values (helpers.NOISE_ULPS)
            tolerance = NOISE_ULPS * EPS32
            largest = reference.detach().abs().max().item() if reference.numel() else 0.0
            torch.testing.assert_close(
                mine,
                reference,
                rtol=tolerance,
                atol=tolerance * largest,
                msg=lambda m: f"{where}: {m}",
            )
    elif isinstance(reference, dict):
        assert mine.keys() == reference.keys(), where
        for key in reference:
            _assert_same(mine[key], reference[key], f"{where}.{key}")
    elif isinstance(reference, (list, tuple)):
        assert len(mine) == len(reference), where
        for i, (a, b) in enumerate(zip(mine, reference, strict=True)):
            _assert_same(a, b, f"{where}[{i}]")
    else:
        assert mine == reference, where


def _as_torch_saves(state_dict, kwargs, torch_kwargs):
    """Without the ``fused`` flag of mixedopt.RMSprop's groups (one torch.optim.RMSprop lacks)."""
    if "fused" in kwargs and "fused" not in torch_kwargs:
        for group in state_dict["param_groups"]:
            assert group.pop("fused") is kwargs["fused"]
    return state_dict


@pytest.mark.parametrize(("name", "kwargs", "torch_kwargs"), list(_cases()))
def test_matches_torch_optim_on_pytorch_configurations(name, kwargs, torch_kwargs):
    mixed_cls, torch_cls = EVERY_OPTIMIZER[name]
    generator = torch.Generator().manual_seed(0)
    shapes = MATRICES if name == "Muon" else SHAPES  # Muon takes matrices only
    initial = [torch.randn(shape, generator=generator) for shape in shapes]
    mine, reference = _parameters(initial), _parameters(initial)
    optimizer = mixed_cls(mine, **copy.deepcopy(kwargs))
    torch_optimizer = torch_cls(reference, **copy.deepcopy(torch_kwargs))
    for step in range(1, STEPS + 1):
        for p, q in zip(mine, reference, strict=True):
            gradient = torch.randn(p.shape, generator=generator) * MAGNITUDES[step - 1]
            (p * gradient).sum().backward()  # autograd's gradient of p: ``gradient`` itself
            q.grad = stored_as_documented(gradient)
        optimizer.step()
        torch_optimizer.step()
        optimizer.zero_grad()  # the next backward's gradient is not added to this one
        _assert_same(
            [p.detach() for p in mine], [q.detach() for q in reference], f"step {step}: weights"
        )
        _assert_same(
            _as_torch_saves(optimizer.state_dict(), kwargs, torch_kwargs),
            torch_optimizer.state_dict(),
            f"step {step}: state_dict",
        )
        if step == CHECKPOINT_AFTER:  # resume both from a checkpoint, as a new process would
            saved, torch_saved = (
                _checkpoint(mine, optimizer),
                _checkpoint(reference, torch_optimizer),
            )
            mine, reference = _parameters(saved["weights"]), _parameters(torch_saved["weights"])
            optimizer = mixed_cls(mine, **copy.deepcopy(kwargs))
            torch_optimizer = torch_cls(reference, **copy.deepcopy(torch_kwargs))
            optimizer.load_state_dict(saved["optim"])
            torch_optimizer.load_state_dict(torch_saved["optim"])

"""fused=True: the compiled kernels' share of a group's update, in a bounded number of calls.

They update RMSprop's parameters, and those of Adam, AdamW and SGD larger than
``_packing.budget(device).fused_small`` (the smaller ones take torch's own fused update, see
``MixedPrecisionOptimizer._fused_step_group``). Parameters of up to ``fused_small`` elements are
packed (``_packing.py``): their weights, gradients and state are copied into buffers of rows
(one ``_foreach_copy_`` for all), updated by one compiled call per ``capacity`` elements, with
each parameter's factor and step coefficients given per row, and copied back. A larger parameter
is updated in place by a compiled call of its own, on 1-D aliases of its memory: its bytes
outweigh the cost of a call. So a group costs one compiled call per ``fused_small`` elements of
its parameters at most (and two compiled variants of each kernel: packed rows, and one
parameter), whatever the number of parameters.

The step counters advance outside the kernels, with one ``_foreach_add_``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _fused
from ._distributed import is_dtensor, local
from ._packing import Entry, Workspace, budget, dense_order, flat_view, packs


def _aliases(param: Tensor, tensors: list[Tensor], workspace: Workspace) -> list[Tensor]:
    """1-D aliases of a parameter's weights and state, kept while they stay on their memory."""
    memory = (param.numel(), *(t.data_ptr() for t in tensors))
    cached = workspace.aliases.get(id(param))
    if cached is None or cached[0] != memory:
        cached = workspace.aliases[id(param)] = (memory, [_fused.flat_alias(t) for t in tensors])
    return cached[1]


def _large_tensors(
    entry: Entry, keys: Sequence[str], workspace: Workspace
) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Parameter, gradient and state of a parameter updated on its own: 1-D when dense."""
    tensors = [entry.param, *(entry.state[key] for key in keys)]
    if (
        all(t.is_contiguous() for t in tensors)
        and entry.grad.is_contiguous()
        and not is_dtensor(entry.param)
    ):
        param, *states = _aliases(entry.param, tensors, workspace)
        return param, _fused.flat_alias(entry.grad), states
    param, grad = local(entry.param), local(entry.grad)
    states = [local(entry.state[key]) for key in keys]
    order = dense_order(param)
    if order is not None:
        flats = [flat_view(t, order) for t in (param, *states)]
        if all(f is not None for f in flats):
            flat_param, *flat_states = flats
            grad = grad.permute(order).reshape(-1)
            return (
                _fused.flat_alias(flat_param),  # type: ignore[arg-type]
                _fused.flat_alias(grad),
                [_fused.flat_alias(s) for s in flat_states],  # type: ignore[arg-type]
            )
    # Compiled code must not see the parameter's 16-bit .grad.
    return param.detach(), grad, states


@torch.no_grad()
def fused_update(
    kernel: Callable[..., None],
    keys: Sequence[str],
    state_order: Sequence[str],
    entries: Sequence[Entry],
    factors: Tensor,
    coefficients: Sequence[Tensor],
    shared: tuple[Any, ...],
    workspace: Workspace,
) -> list[int]:
    """Update ``entries`` (all on one device) with the compiled ``kernel``.

    ``factors`` and each of ``coefficients`` hold one value per entry; ``shared`` is what every
    call shares (the skip flag, then the group's hyperparameters). Returns the indices of the
    entries left not updated because no compiler works here (after one warning).
    """
    device = factors.device
    limits = budget(device)
    # A pack holds one gradient dtype.
    packed, large = packs(
        entries, limits.fused_small, limits.capacity, lambda i: entries[i].grad.dtype
    )
    done: list[int] = []
    for pack in packed:
        index = workspace.index(pack, device)
        chosen = [entries[i] for i in pack]
        if not _run_pack(
            kernel, keys, state_order, chosen, index, factors, coefficients, shared, workspace
        ):
            return sorted(set(range(len(entries))) - set(done))
        done += pack
    for i in large:
        e = entries[i]
        param, grad, states = _large_tensors(e, keys, workspace)
        by_key = dict(zip(keys, states, strict=True))
        arguments = (
            param,
            grad,
            factors[i],
            *[by_key.get(key) for key in state_order],
            *[c[i] for c in coefficients],
            *shared,
        )
        if not _fused.run(kernel, arguments):
            return sorted(set(range(len(entries))) - set(done))
        done.append(i)
    return []


def _run_pack(
    kernel: Callable[..., None],
    keys: Sequence[str],
    state_order: Sequence[str],
    pack: list[Entry],
    index: Tensor,
    factors: Tensor,
    coefficients: Sequence[Tensor],
    shared: tuple[Any, ...],
    workspace: Workspace,
) -> bool:
    """Copy a pack in, run one compiled call on its rows, copy it back."""
    params = [e.param for e in pack]
    layout = workspace.layout([p.numel() for p in params], factors.device)
    param_rows, param_views = workspace.rows("param", torch.float32, layout, params)
    grad_rows, grad_views = workspace.rows("grad", pack[0].grad.dtype, layout, params)
    state_rows: dict[str, Tensor] = {}
    state_views: list[Tensor] = []
    for key in keys:
        state_rows[key], views = workspace.rows(key, torch.float32, layout, params)
        state_views += views
    states = [e.state[key] for key in keys for e in pack]
    torch._foreach_copy_(
        [*param_views, *state_views, *grad_views], [*params, *states, *(e.grad for e in pack)]
    )

    def per_row(values: Tensor) -> Tensor:
        return layout.per_row(values.index_select(0, index))

    arguments = (
        param_rows,
        grad_rows,
        per_row(factors),
        *[state_rows.get(key) for key in state_order],
        *[per_row(c) for c in coefficients],
        *shared,
    )
    if not _fused.run(kernel, arguments):
        return False
    torch._foreach_copy_([*params, *states], [*param_views, *state_views])
    return True

"""``fused=True``: a group's update by kernels that read the 16-bit gradients.

``FusedPath`` (a component of ``MixedPrecisionOptimizer``): torch's fused update for parameters of
up to ``budget(device).fused_small`` elements where the parent has one, mixedopt's compiled
kernels (``_compiled.py``) for the others, packed or a few large ones per call; the default path
where no compiler is available.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

from . import _compiled
from ._budget import budget
from ._choice import Implementation, fused_requested, implementation
from ._default_step import StoredRowsLookup, default_update
from ._distributed import is_dtensor, local
from ._entries import Entry, by_device, packs
from ._rules import UpdateRules
from ._strides import dense_order, flat_view
from ._workspace import Workspace


def _aliases(param: Tensor, tensors: list[Tensor], workspace: Workspace) -> list[Tensor]:
    """1-D aliases of a parameter's weights and state, kept while they stay on their memory."""
    memory = (param.numel(), *(t.data_ptr() for t in tensors))
    cached = workspace.aliases.get(id(param))
    if cached is None or cached[0] != memory:
        cached = workspace.aliases[id(param)] = (memory, [_compiled.flat_alias(t) for t in tensors])
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
        return param, _compiled.flat_alias(entry.grad), states
    param, grad = local(entry.param), local(entry.grad)
    states = [local(entry.state[key]) for key in keys]
    order = dense_order(param)
    if order is not None:
        flats = [flat_view(t, order) for t in (param, *states)]
        if all(f is not None for f in flats):
            flat_param, *flat_states = flats
            grad = grad.permute(order).reshape(-1)
            return (
                _compiled.flat_alias(flat_param),  # type: ignore[arg-type]
                _compiled.flat_alias(grad),
                [_compiled.flat_alias(s) for s in flat_states],  # type: ignore[arg-type]
            )
    # Compiled code must not see the parameter's 16-bit .grad.
    return param.detach(), grad, states


@torch.no_grad()
def run_compiled_kernels(
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
    with _compiled.recompiles_allowed():  # for all calls of this step
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
        # Large parameters: dense ones by lists (one compiled call for several), others alone.
        lists: dict[torch.dtype, list[tuple[int, tuple[Tensor | None, ...]]]] = {}
        for i in large:
            param, grad, states = _large_tensors(entries[i], keys, workspace)
            by_key = dict(zip(keys, states, strict=True))
            tensors = (param, grad, *[by_key.get(key) for key in state_order])
            if param.dim() == 1 and grad.dim() == 1 and param.is_contiguous():
                lists.setdefault(grad.dtype, []).append((i, tensors))
                continue
            arguments = (*tensors[:2], factors[i], *tensors[2:], *[c[i] for c in coefficients])
            if not _compiled.run(kernel, (*arguments, *shared)):
                return sorted(set(range(len(entries))) - set(done))
            done.append(i)
        length = _compiled.PARAMETERS_PER_CALL
        for listed in lists.values():
            for start in range(0, len(listed), length):
                one_call = listed[start : start + length]
                padding = workspace.padding(length - len(one_call), one_call[0][1])
                # Scratch parameters take the first one's factor and coefficients.
                positions = [i for i, _ in one_call] + [one_call[0][0]] * len(padding)
                index = workspace.index(positions, device)
                parameters = [tensors for _, tensors in one_call] + padding
                vectors = [c.index_select(0, index) for c in coefficients]
                selected = factors.index_select(0, index)
                if not _compiled.run_each(kernel, parameters, selected, vectors, shared):
                    return sorted(set(range(len(entries))) - set(done))
                done += [i for i, _ in one_call]
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
    if not _compiled.run(kernel, arguments):
        return False
    torch._foreach_copy_([*params, *states], [*param_views, *state_views])
    return True


class FusedPath:
    """The ``fused=True`` step of a group, a component of the optimizer; see the module."""

    def __init__(
        self,
        rules: UpdateRules,
        workspace: Workspace,
        stored_bucket: StoredRowsLookup,
        reference_update: Callable[[dict[str, Any], list[Entry], Tensor], None],
    ) -> None:
        self.rules = rules
        self.workspace = workspace
        self.stored_bucket = stored_bucket  # the storage's rows of a stored bucket
        # The reference path's update of a group's entries, for what cannot be compiled.
        self.reference_update = reference_update

    def takes(self, group: dict[str, Any], entries: list[Entry]) -> bool:
        """Whether this group steps with the compiled kernels now.

        Only once every parameter has its state: the first step runs the default path, which
        creates the state exactly as the parent does (and skips without creating any).
        """
        if not fused_requested(group) or self.rules._compiled_kernel is None:
            return False  # without kernels of its own, torch's fused update on the default path
        if not _compiled.available():
            return False
        keys = self.rules._state_keys(group)
        return all(key in self.rules.state.get(e.param, {}) for e in entries for key in keys)

    def step_group(
        self, group: dict[str, Any], entries: list[Entry], factors: Tensor, skip: Tensor | None
    ) -> None:
        """Update ``entries`` with fused updates that read no host value.

        Parameters of up to ``budget(device).fused_small`` elements go to torch's own
        fused update, on float32 gradients upcast in bounded batches as on the default path
        (Adam, AdamW, SGD); without one (RMSprop) they are packed for the compiled kernels. Larger
        parameters are updated by the compiled kernels (``run_compiled_kernels``), which read the
        16-bit gradients directly. ``skip`` is None on the CPU (the caller does not step when a
        gradient is inf/NaN); on an accelerator both keep the old values where it is set.
        """
        keys = self.rules._state_keys(group)
        for device, (device_entries, device_factors) in by_device(entries, factors).items():
            device_skip = None if skip is None else skip.to(device)
            if keys:  # like the parent, an optimizer with no state records none
                for e in device_entries:
                    e.state = self.rules.state[e.param]
            if self.rules._parent_has_torch_fused:
                taken = [
                    i
                    for i, e in enumerate(device_entries)
                    if implementation(group, [e.param], torch_fused=True, compiled=True)
                    is Implementation.TORCH_FUSED
                ]
                if taken:
                    self._torch_fused(group, device_entries, device_factors, taken, device_skip)
                    kept = sorted(set(range(len(device_entries))) - set(taken))
                    device_entries = [device_entries[i] for i in kept]
                    device_factors = device_factors[self.workspace.index(kept, device)]
            if device_entries:
                self._compiled(group, keys, device_entries, device_factors, device_skip)

    def _torch_fused(
        self,
        group: dict[str, Any],
        entries: list[Entry],
        factors: Tensor,
        taken: list[int],
        skip: Tensor | None,
    ) -> None:
        """Torch's fused update of ``entries[i] for i in taken``.

        On an accelerator ``skip`` goes to it as ``found_inf``: nothing changes where it is set.
        """
        device = factors.device
        chosen = [entries[i] for i in taken]
        if len(chosen) != len(entries):
            factors = factors[self.workspace.index(taken, device)]
        found_inf = None if skip is None else skip.float()

        def update(params: list[Tensor], grads: list[Tensor], states: Any, steps: Any) -> None:
            self.rules._update(group, params, grads, states, steps, found_inf=found_inf)

        default_update(
            update,
            self.rules._state_keys(group),
            chosen,
            factors,
            self.workspace,
            self.stored_bucket,
        )

    def _compiled(
        self,
        group: dict[str, Any],
        keys: list[str],
        entries: list[Entry],
        factors: Tensor,
        skip: Tensor | None,
    ) -> None:
        """Update ``entries`` (on one device) with the compiled kernels."""
        device = factors.device
        # maximize: the kernels get the negated gradient, as torch's update negates it.
        signed = -factors if group["maximize"] else factors
        steps = []
        for e in entries:
            step = e.state.get("step")
            if step is not None:
                if step.device != device:  # from a non-fused checkpoint
                    step = e.state["step"] = step.to(device)
                steps.append(step)
        coefficients = self.rules._compiled_coefficients(group, torch.stack(steps)) if steps else []
        kernel = self.rules._compiled_kernel
        assert kernel is not None  # ``takes`` said so
        left = run_compiled_kernels(
            kernel,
            keys,
            self.rules._compiled_state_order,
            entries,
            signed,
            coefficients,
            (skip, *self.rules._compiled_hyperparameters(group)),
            self.workspace,
        )
        done = set(range(len(entries))) - set(left)
        advanced = [steps[i] for i in sorted(done)] if steps else []
        if advanced and skip is None:
            torch._foreach_add_(advanced, 1)
        elif advanced and skip is not None:
            # A list of 0-dim tensors, as torch's fused Adam does: a 0-dim tensor in place of
            # the list would be read on the host, as a Python number.
            torch._foreach_add_(advanced, [(~skip).float()] * len(advanced))
        if left and skip is None:  # no compiler: the rest takes the default path
            rest = factors[self.workspace.index(left, device)]
            self.reference_update(group, [entries[i] for i in left], rest)

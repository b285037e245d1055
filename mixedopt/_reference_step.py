"""The reference path of a step: each gradient taken on its own, as an ``Entry``.

``ReferencePath``, a component of the optimizer (``_stages.StepStages`` holds it), finds the
entries a step updates (``entries``), every factor and the skip at once (``factors_and_skip``),
and updates a group's entries (``step_group``). It takes every gradient, however it is stored;
the bucket path and ``fused=True`` are tested against it. See docs/design.md, "The step".
"""

from __future__ import annotations

import math
import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import Tensor

from ._budget import budget
from ._default_step import default_update
from ._distributed import full_values, is_dtensor
from ._entries import Entry, by_device
from ._rules import UpdateRules
from ._scales import abs_max, any_non_finite
from ._storage import SUPPORTED_GRAD_DTYPES, GradientStorage
from ._strides import dense_order, flat_view
from ._workspace import Workspace

_LIBRARY_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first caller outside mixedopt and torch.

    ``step()`` is reached through torch's wrappers (hooks, no_grad, torch.compiler.disable).
    """
    level = 1
    frame: FrameType | None = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRS):
        level, frame = level + 1, frame.f_back
    return level


def _per_gradient(
    entries: list[Entry],
    device: torch.device,
    order: float,
    joins: Callable[[Tensor], object],
    alone: Callable[[Tensor], Tensor],
) -> Tensor:
    """The float32 ``order``-norm of each stored gradient, a 1-D tensor on ``device``.

    Those on ``device`` that ``joins`` takes in one ``_foreach_norm``, each other by ``alone``;
    a sharded gradient's is reduced over ranks (``full_values``).
    """
    found: list[Tensor | None] = [None] * len(entries)
    together = [
        i
        for i, e in enumerate(entries)
        if e.grad.device == device and not is_dtensor(e.grad) and joins(e.grad)
    ]
    if together:
        grads = [entries[i].grad for i in together]
        for i, value in zip(
            together, torch._foreach_norm(grads, order, dtype=torch.float32), strict=True
        ):
            found[i] = value
    values = [alone(e.grad) if v is None else v for e, v in zip(entries, found, strict=True)]
    return torch.stack([v.to(device) for v in full_values(values)])


def _l2_norm(grad: Tensor) -> Tensor:
    """L2 norm in float32, slice by slice: no float32 copy of a whole large gradient."""
    capacity = budget(grad.device).capacity
    # A sharded (DTensor) gradient: its own norm, a value to be reduced over ranks (full_values).
    order = None if grad.numel() <= capacity or is_dtensor(grad) else dense_order(grad)
    flat = None if order is None else flat_view(grad, order)
    if flat is None:
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    parts = [
        torch.linalg.vector_norm(flat[start : start + capacity], dtype=torch.float32)
        for start in range(0, flat.numel(), capacity)
    ]
    return torch.linalg.vector_norm(torch.stack(parts))


class ReferencePath:
    """The reference path of ``step()``; see the module's docstring."""

    def __init__(
        self, rules: UpdateRules, storage: GradientStorage, workspace: Workspace, name: str
    ) -> None:
        self.rules = rules
        self.storage = storage
        self.workspace = workspace
        self.name = name  # the optimizer's class name, for messages

    def warn_if_changed_in_place(self, entries: list[Entry]) -> bool:
        """Warn when code changed stored float16 gradients in place before ``step()``.

        Returns whether it warned (the optimizer warns once).

        They hold the true gradient times a per-tensor scale, so what such code computed from
        them (a clipping norm, above all) is wrong. A change that left the largest magnitude as
        stored (clipping by a coefficient of 1, which Hugging Face's Trainer does to log a norm)
        is no change; nor are gradients zeroed in place (``zero_grad(set_to_none=False)`` before a
        backward that gave them nothing).
        """
        changed = [e for e in entries if e.stats is not None and not e.amax_current]
        if not changed:
            return False
        device = changed[0].grad.device
        stats, _ = self.storage.stats_table([(e.stats, e.row) for e in changed], device)
        # The largest magnitude of each, as stored.
        stored = (stats[:, 0] * stats[:, 1]).to(self.storage.grad_dtype).float()
        grads = [e.grad for e in changed]
        if all(g.device == device and g.numel() and not is_dtensor(g) for g in grads):
            # Every step under Hugging Face's Trainer (it clips by infinity): one operation.
            now = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
        else:
            now = torch.stack([abs_max(g).to(device) for g in grads])
        if not bool(((now != stored) & (now > 0)).any()):
            return False
        name = self.name
        warnings.warn(
            f"mixedopt.{name}: the float16 .grad of parameters was changed in "
            "place between backward() and step(), for example by "
            "torch.nn.utils.clip_grad_norm_ (Hugging Face Trainer's max_grad_norm, Lightning's "
            "gradient_clip_val). Each holds the true gradient times its own power-of-two scale, "
            "so a norm computed from .grad is not the gradient's norm and clipping by it scales "
            f"the update wrongly. Clip with mixedopt.{name}(..., max_grad_norm=...) instead "
            "(optimizer.last_grad_norm holds the norm to log) and turn the framework's clipping "
            "off, or use grad_dtype=torch.bfloat16, whose .grad holds true values. Warned once.",
            UserWarning,
            stacklevel=user_stacklevel(),
        )
        return True

    def entries(
        self, params: list[Tensor], taken: set[int] | frozenset[int] = frozenset()
    ) -> list[Entry]:
        """The parameters of ``params`` that have a gradient, as ``step()`` takes them.

        Those whose id is in ``taken`` are left out (a whole bucket takes them).
        """
        name = self.name
        storage = self.storage
        found = []
        for p in params:
            grad = p.grad
            if grad is None or (taken and id(p) in taken):
                continue
            if grad.is_sparse:
                raise RuntimeError(
                    f"mixedopt.{name} does not support sparse gradients; use dense gradients "
                    "(for example nn.Embedding(sparse=False))"
                )
            if grad.dtype not in (torch.float32, *SUPPORTED_GRAD_DTYPES):
                raise RuntimeError(
                    f"mixedopt.{name} got a gradient of dtype {grad.dtype}; a gradient must be "
                    "float16, bfloat16 or float32"
                )
            found.append(Entry(p, grad, *storage.stats_of(p), is_dtensor(p)))
        return found

    def factors_and_skip(
        self,
        entries: list[Entry],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        max_grad_norm: float | None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """Each gradient's factor (to its true, unscaled, clipped value) and the skip flag.

        The factors are a 1-D float32 tensor (one per entry) and the flag a 0-dim bool tensor,
        both on the first parameter's device, computed with a fixed number of operations and
        without host synchronisation. With ``max_grad_norm`` (clipping) also the L2 norm of all
        true gradients before clipping, computed as ``clip_grad_norm_`` does (the optimizer's
        ``last_grad_norm``); else ``None``.
        """
        device = entries[0].param.device
        # None: 1 and False, without an operation to make them.
        unscale = None
        skip = None
        if grad_scale is not None:
            unscale = grad_scale.to(device=device, dtype=torch.float32).reciprocal()
        if found_inf is not None:  # GradScaler checked every gradient already
            skip = found_inf.to(device) > 0
        # One row [storage scale, |true gradient| bound] per gradient.
        stats, _ = self.storage.stats_table([(e.stats, e.row) for e in entries], device)
        scales = stats[:, 0]
        total = None
        if max_grad_norm is not None:
            norms = self._stored_norms(entries, device) / scales
            total = torch.linalg.vector_norm(norms if unscale is None else norms * unscale)
            non_finite = any_non_finite(total)
            skip = non_finite if skip is None else skip | non_finite
            clip = torch.clamp(max_grad_norm / (total + 1e-6), max=1.0)
            unscale = clip if unscale is None else unscale * clip
        elif found_inf is None:
            amax = stats[:, 1]
            # Backward measured the gradients it stored: only the others are read here.
            unknown = [i for i, e in enumerate(entries) if not e.amax_current]
            if unknown:
                measured = self._stored_abs_maxes([entries[i] for i in unknown], device)
                at = torch.tensor(unknown, device=device)
                amax = amax.index_put((at,), measured / scales[at])
            skip = any_non_finite(amax)
        assert skip is not None  # set by one of the three cases above
        factors = scales.reciprocal() if unscale is None else unscale / scales
        return factors, skip, total

    @staticmethod
    def _stored_norms(entries: list[Entry], device: torch.device) -> Tensor:
        """The float32 L2 norm of each stored gradient (a 1-D tensor on ``device``)."""
        capacity = budget(device).capacity
        return _per_gradient(entries, device, 2, lambda g: g.numel() <= capacity, _l2_norm)

    @staticmethod
    def _stored_abs_maxes(entries: list[Entry], device: torch.device) -> Tensor:
        """The largest magnitude of each stored gradient (a 1-D float32 tensor on ``device``).

        On an accelerator, one operation for those on ``device``; on a CPU each its own
        (``abs_max``: faster there than an inf-norm).
        """
        on_host = budget(device).on_host
        return _per_gradient(
            entries, device, math.inf, lambda g: g.numel() and not on_host, abs_max
        )

    def step_group(
        self,
        group: dict[str, Any],
        entries: list[Entry],
        factors: Tensor,
        unscaled: bool = False,
    ) -> None:
        """Update ``entries`` of ``group`` by the parent's functional update, in bounded batches.

        ``factors`` holds each gradient's factor to its true value (``factors_and_skip``);
        ``unscaled``: no loss scale and no clipping (``default_update``).
        """
        rules = self.rules
        keys = rules._state_keys(group)
        for e in entries:
            # Like the parent, an optimizer with no state (SGD without momentum) records none.
            if keys:
                e.state = rules.state[e.param]
                rules._init_state(e.param, group, e.state)
            for key in rules._created_by_update(group):
                if e.state.get(key) is None:
                    e.created[key] = torch.empty_like(e.param)

        def update(params: list[Tensor], grads: list[Tensor], states: Any, steps: Any) -> None:
            rules._update(group, params, grads, states, steps)

        for device_entries, device_factors in by_device(entries, factors).values():
            default_update(
                update,
                keys,
                device_entries,
                device_factors,
                self.workspace,
                self.storage.stored_bucket,
                cut=not rules._updates_whole_parameters,
                unscaled=unscaled,
            )
        for e in entries:
            e.state.update(e.created)

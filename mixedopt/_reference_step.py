"""The reference path of a step: each gradient taken on its own, as an ``Entry``.

``ReferenceSteps`` (mixed into ``MixedPrecisionOptimizer``) collects what a step updates
(``_collect``), finds every factor and the skip at once (``_factors_and_skip``), and updates the
entries of each group (``_step_entries``). It takes every gradient, however it is stored; the
bucket path and ``fused=True`` are tested against it. See docs/design.md, "The step".
"""

from __future__ import annotations

import os
import sys
import warnings
from collections.abc import Callable
from types import FrameType
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _packing
from ._bucket_step import WholeBucketPath
from ._bucket_store import WholeBucket
from ._default_step import default_update
from ._distributed import full_values, is_dtensor
from ._fused_step import FusedPath
from ._packing import Entry, Workspace, by_device, dense_order, flat_view
from ._scales import abs_max, any_non_finite
from ._storage import SUPPORTED_GRAD_DTYPES, GradientStorage

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


def _l2_norm(grad: Tensor) -> Tensor:
    """L2 norm in float32, slice by slice: no float32 copy of a whole large gradient."""
    capacity = _packing.budget(grad.device).capacity
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


class Collected(NamedTuple):
    """What a step updates: the whole buckets, and the other gradients per group, as entries."""

    buckets: list[WholeBucket]
    steps: list[tuple[dict[str, Any], list[Entry]]]

    def __bool__(self) -> bool:
        return bool(self.buckets or self.steps)


class Scaling(NamedTuple):
    """Each gradient's factor to its true value, and whether the step is skipped."""

    factors: Tensor | None  # one per entry, in order
    bucket_unscale: Tensor | None  # GradScaler's and clipping's, for the whole buckets
    skip: Tensor  # 0-dim bool: a gradient is inf or NaN, or GradScaler found one
    fused: bool  # every group takes the fused=True path
    on_device: bool  # the skip is decided on the device (no host read)

    def read_skip(self) -> bool:
        """Whether the step is skipped, read on the host unless decided on the device."""
        # On the CPU reading the flag costs nothing; on an accelerator the fused kernels keep
        # the old values where it is set, without host synchronisation, and the default path
        # synchronises once, here.
        return not self.on_device and bool(self.skip)


class ReferenceSteps:
    """The reference path of ``step()``; see the module's docstring."""

    # The optimizer's own (``_core.MixedPrecisionOptimizer``, torch.optim's classes and the
    # optimizer files), and the components of its step it owns.
    param_groups: list[dict[str, Any]]
    state: Any
    grad_dtype: torch.dtype
    max_grad_norm: float | None
    last_grad_norm: Tensor | None
    _grad_storage: GradientStorage
    _workspace: Workspace
    _warned_changed_in_place: bool
    _skipped_on_device: Tensor | None
    _whole_buckets: WholeBucketPath
    _fused_path: FusedPath
    _state_keys: Callable[[dict[str, Any]], list[str]]
    _init_state: Callable[[Tensor, dict[str, Any], dict[str, Any]], None]
    _update: Callable[..., None]

    def _take_whole_buckets(
        self, params: list[list[Tensor]] | None = None
    ) -> tuple[list[WholeBucket], int | None]:
        """The whole buckets this step takes, and the gradients it leaves (``WholeBucketPath``)."""
        return self._whole_buckets.take(params, self.max_grad_norm)

    def _scaling(
        self,
        collected: Collected,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        on_host: bool = False,
    ) -> Scaling:
        """Each gradient's factor to its true value, and whether the step is skipped.

        Skipped, nothing changed, when GradScaler's ``found_inf`` is set or a gradient is inf
        or NaN. The default path reads that flag on the host (``Scaling.read_skip``): on an
        accelerator, the one host synchronisation of a step (torch's foreach and for-loop
        updates cannot skip on the device). Fused steps on an accelerator decide it on the
        device unless ``on_host``: no synchronisation.
        """
        buckets, steps = collected
        entries = [e for _, group_entries in steps for e in group_entries]
        skips, factors, unscale = [], None, None
        if entries:
            factors, skip = self._factors_and_skip(entries, grad_scale, found_inf)
            skips.append(skip)
        if buckets:
            unscale, skip = self._whole_buckets.factors_and_skip(buckets, grad_scale, found_inf)
            skips.append(skip)
        skip = skips[0] if len(skips) == 1 else skips[0] | skips[1].to(skips[0].device)
        bucket_groups = set().union(*(bucket.groups for bucket in buckets))
        fused = all(self._fused_path.takes(group, entries) for group, entries in steps) and all(
            self._fused_path.takes(self.param_groups[index], []) for index in bucket_groups
        )
        on_device = fused and not on_host and not _packing.budget(skip.device).on_host
        return Scaling(factors, unscale, skip, fused, on_device)

    def _update_collected(self, collected: Collected, scaling: Scaling) -> None:
        """Update the whole buckets, then each group's entries, with ``scaling``'s factors."""
        buckets, steps = collected
        device_skip = scaling.skip if scaling.on_device else None
        if buckets:
            self._whole_buckets.update(buckets, scaling.bucket_unscale, device_skip)
        start = 0
        for group, group_entries in steps:
            assert scaling.factors is not None
            group_factors = scaling.factors[start : start + len(group_entries)]
            start += len(group_entries)
            if scaling.fused:
                self._fused_path.step_group(group, group_entries, group_factors, device_skip)
            else:
                self._step_group(group, group_entries, group_factors)
        if scaling.on_device:
            if self._skipped_on_device is None:
                self._skipped_on_device = torch.zeros(
                    (), dtype=torch.int64, device=scaling.skip.device
                )
            self._skipped_on_device += scaling.skip

    def _step_entries(
        self,
        collected: Collected,
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        on_host: bool = False,
    ) -> bool:
        """Scale and update ``collected``; ``False``, nothing changed, where the step is skipped."""
        scaling = self._scaling(collected, grad_scale, found_inf, on_host)
        if scaling.read_skip():
            return False
        self._update_collected(collected, scaling)
        return True

    def _warn_if_changed_in_place(self, entries: list[Entry]) -> None:
        """Warn, once, when code changed stored float16 gradients in place before ``step()``.

        They hold the true gradient times a per-tensor scale, so what such code computed from
        them (a clipping norm, above all) is wrong. A change that left the largest magnitude as
        stored (clipping by a coefficient of 1, which Hugging Face's Trainer does to log a norm)
        is no change; nor are gradients zeroed in place (``zero_grad(set_to_none=False)`` before a
        backward that gave them nothing).
        """
        changed = [e for e in entries if e.stats is not None and not e.amax_current]
        if not changed:
            return
        device = changed[0].grad.device
        stats, _ = self._grad_storage.stats_table([(e.stats, e.row) for e in changed], device)
        stored = (stats[:, 0] * stats[:, 1]).to(self.grad_dtype).float()  # largest when stored
        grads = [e.grad for e in changed]
        if all(g.device == device and g.numel() and not is_dtensor(g) for g in grads):
            # Every step under Hugging Face's Trainer (it clips by infinity): one operation.
            now = torch.stack(torch._foreach_norm(grads, float("inf"))).float()
        else:
            now = torch.stack([abs_max(g).to(device) for g in grads])
        if not bool(((now != stored) & (now > 0)).any()):
            return
        self._warned_changed_in_place = True
        name = type(self).__name__
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

    def _collect(self, params: list[list[Tensor]] | None = None) -> Collected:
        """What a step updates: the whole buckets, and the other gradients per group.

        Among ``params`` (a list per parameter group; default: all of them).
        """
        buckets, left = self._take_whole_buckets(params)
        if left == 0:  # every gradient is in a whole bucket
            return Collected(buckets, [])
        taken = {id(param) for bucket in buckets for param in bucket.params}
        if params is None:
            params = [group["params"] for group in self.param_groups]
        steps = [
            (group, self._entries(chosen, taken))
            for group, chosen in zip(self.param_groups, params, strict=True)
        ]
        return Collected(buckets, [(group, entries) for group, entries in steps if entries])

    def _entries(
        self, params: list[Tensor], taken: set[int] | frozenset[int] = frozenset()
    ) -> list[Entry]:
        """The parameters of ``params`` that have a gradient, as ``step()`` takes them.

        Those whose id is in ``taken`` are left out (a whole bucket takes them).
        """
        name = type(self).__name__
        storage = self._grad_storage
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

    def _factors_and_skip(
        self, entries: list[Entry], grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Each gradient's factor (to its true, unscaled, clipped value) and the skip flag.

        The factors are a 1-D float32 tensor (one per entry) and the flag a 0-dim bool tensor,
        both on the first parameter's device, computed with a fixed number of operations and
        without host synchronisation. With ``max_grad_norm`` it also records
        ``last_grad_norm``, the L2 norm of all true gradients before clipping, computed as
        ``clip_grad_norm_`` does.
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
        stats, _ = self._grad_storage.stats_table([(e.stats, e.row) for e in entries], device)
        scales = stats[:, 0]
        if self.max_grad_norm is not None:
            norms = self._stored_norms(entries, device) / scales
            total = torch.linalg.vector_norm(norms if unscale is None else norms * unscale)
            self.last_grad_norm = total
            non_finite = any_non_finite(total)
            skip = non_finite if skip is None else skip | non_finite
            clip = torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
            unscale = clip if unscale is None else unscale * clip
        elif found_inf is None:
            amax = stats[:, 1]
            # Backward measured the gradients it stored: only the others are read here.
            unknown = [i for i, e in enumerate(entries) if not e.amax_current]
            if unknown:
                measured = full_values(abs_max(entries[i].grad) for i in unknown)
                at = torch.tensor(unknown, device=device)
                amax = amax.index_put(
                    (at,), torch.stack([m.to(device) for m in measured]) / scales[at]
                )
            skip = any_non_finite(amax)
        assert skip is not None  # set by one of the three cases above
        return (scales.reciprocal() if unscale is None else unscale / scales), skip

    @staticmethod
    def _stored_norms(entries: list[Entry], device: torch.device) -> Tensor:
        """The float32 L2 norm of each stored gradient (a 1-D tensor on ``device``)."""
        norms: list[Tensor | None] = [None] * len(entries)
        capacity = _packing.budget(device).capacity
        together = [
            i
            for i, e in enumerate(entries)
            if e.grad.device == device and e.grad.numel() <= capacity and not is_dtensor(e.grad)
        ]
        if together:
            found = torch._foreach_norm([entries[i].grad for i in together], 2, dtype=torch.float32)
            for i, norm in zip(together, found, strict=True):
                norms[i] = norm
        for i, e in enumerate(entries):
            if norms[i] is None:
                norms[i] = _l2_norm(e.grad)
        return torch.stack([n.to(device) for n in full_values(norms)])  # type: ignore[arg-type]

    def _step_group(self, group: dict[str, Any], entries: list[Entry], factors: Tensor) -> None:
        keys = self._state_keys(group)
        for e in entries:
            # Like the parent, an optimizer with no state (SGD without momentum) records none.
            if keys:
                e.state = self.state[e.param]
                self._init_state(e.param, group, e.state)
            for key in keys:
                if e.state.get(key) is None:
                    e.created[key] = torch.empty_like(e.param)

        def update(params: list[Tensor], grads: list[Tensor], states: Any, steps: Any) -> None:
            self._update(group, params, grads, states, steps)

        for device_entries, device_factors in by_device(entries, factors).values():
            default_update(
                update,
                keys,
                device_entries,
                device_factors,
                self._workspace,
                self._grad_storage.stored_bucket,
            )
        for e in entries:
            e.state.update(e.created)

"""The mixed-precision machinery shared by every mixedopt optimizer.

``MixedPrecisionOptimizer`` is a mixin placed before a ``torch.optim`` class. It installs the
gradient storage (``_storage.py``) at construction. Its ``step()`` first takes the buckets
backward stored whose gradients are all its own and untouched (``BucketSteps`` of
``_bucket_step.py``: nothing per parameter but its state). For the other gradients it finds,
for all of them at once, each gradient's factor (1 / storage scale x 1 / loss scale x clip
coefficient); the step is skipped if any gradient of either kind is inf or NaN. It then updates
each group on one of two paths: the default one
(``_default_step.py``: float32 gradients in bounded batches, handed to the parent's public
functional update ``rmsprop()``, ``adam()`` or ``sgd()``), or ``fused=True`` (torch's fused
update for small parameters where the parent has one, else compiled kernels that read the
16-bit gradients: ``FusedSteps`` of ``_fused_step.py``, mixed into this class). An optimizer
file only says how its state is created and which functional and kernel to call.
``step_in_backward()`` (``_in_backward.py``) runs the same update on each bucket of gradients
as backward stores it.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref
from collections.abc import Callable
from types import FrameType
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import _device_dtype_check_for_fused

from . import _packing
from ._bucket_step import BucketSteps
from ._bucket_store import WholeBucket
from ._default_step import default_update
from ._distributed import full_values, is_dtensor
from ._fused_step import FusedSteps
from ._in_backward import UpdatingBackward, grad_scaler_error
from ._packing import Entry, Workspace, by_device, dense_order, flat_view
from ._scales import abs_max, any_non_finite
from ._storage import SUPPORTED_GRAD_DTYPES, GradientStorage

_UNSUPPORTED_FLAGS = ("capturable", "differentiable")
_LIBRARY_DIRS = (os.path.dirname(__file__), os.path.dirname(torch.__file__))


def _user_stacklevel() -> int:
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


class MixedPrecisionOptimizer(BucketSteps, FusedSteps, torch.optim.Optimizer):
    """Float32 master weights and state, 16-bit gradients; mixed into a ``torch.optim`` class.

    At construction every parameter (it must be float32) gets what makes its ``.grad`` land in
    ``grad_dtype`` after ``backward()``: in float16 the true gradient times a per-tensor
    power-of-two storage scale (``true_grad`` undoes it), in bfloat16 the true gradient. Several
    optimizers may hold a parameter; its storage goes with the last. ``step()`` upcasts and
    unscales the gradients in bounded batches and applies the parent's float32 update to float32
    weights and state.

    Args:
        grad_dtype: dtype of the stored gradients, ``torch.float16`` (default) or
            ``torch.bfloat16``.
        max_grad_norm: if set, ``step()`` clips the true gradients of all parameter groups to this
            global L2 norm, as ``torch.nn.utils.clip_grad_norm_`` would on float32 gradients.

    Attributes:
        grad_dtype: dtype of the stored gradients.
        max_grad_norm: the clipping norm, or ``None``.
        last_grad_norm: with ``max_grad_norm``, the L2 norm of all true gradients (before
            clipping) at the last ``step()`` that had gradients, a 0-dim float32 tensor;
            ``None`` before that and without ``max_grad_norm``.
        skipped_steps: steps skipped because a gradient was inf or NaN (GradScaler's included
            with float16 gradients; with bfloat16 ones GradScaler skips without calling step()).
            Reading it after fused steps on an accelerator synchronises with the device.
    """

    # Whether GradScaler hands step() its scale and found_inf (set per instance, see _set_up).
    _step_supports_amp_scaling: bool

    def __init__(
        self,
        params: Any,
        *args: Any,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
        **kwargs: Any,
    ) -> None:
        name = type(self).__name__
        if grad_dtype not in SUPPORTED_GRAD_DTYPES:
            raise ValueError(
                f"Invalid grad_dtype: {grad_dtype}; mixedopt.{name} stores gradients in "
                "torch.float16 or torch.bfloat16"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(
                f"Invalid max_grad_norm value: {max_grad_norm}; use a positive number, or None "
                "for no clipping"
            )
        self._set_up(grad_dtype, max_grad_norm, skipped_steps=0)
        try:
            super().__init__(params, *args, **kwargs)
        except BaseException:
            self._release_storage()
            raise
        self._step_supports_amp_scaling = grad_dtype == torch.float16  # the parent's fused sets it

    def _set_up(
        self, grad_dtype: torch.dtype, max_grad_norm: float | None, skipped_steps: int
    ) -> None:
        self.grad_dtype = grad_dtype
        self.max_grad_norm = max_grad_norm
        # GradScaler hands float16 optimizers its scale and found_inf (it refuses to unscale
        # float16 gradients itself); bfloat16 gradients hold true values, which GradScaler
        # unscales as it does for torch.optim, so that unscale_() and clipping work as there.
        self._step_supports_amp_scaling = grad_dtype == torch.float16
        self._warned_changed_in_place = False
        # step_in_backward(): the mode when on, whether its backward updated the weights since
        # the last step(), whether DDP was looked for.
        self._in_backward: UpdatingBackward | None = None
        self._updated_in_backward = False
        self._ddp_checked = False
        self.last_grad_norm: Tensor | None = None
        self._skipped_on_host = skipped_steps
        self._skipped_on_device: Tensor | None = None  # fused steps on an accelerator
        self._workspace = Workspace()  # buffers gradients are upcast and parameters packed into
        self._grad_storage = GradientStorage.shared(grad_dtype)
        self._held_params: set[int] = set()  # ids of the parameters this optimizer holds
        # The storage does not reference the optimizer: its parameters are let go when it dies.
        self._release_storage: weakref.finalize = weakref.finalize(
            self, self._grad_storage.release, self._held_params
        )

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["mixedopt"] = {
            "grad_dtype": self.grad_dtype,
            "max_grad_norm": self.max_grad_norm,
            "skipped_steps": self.skipped_steps,
        }
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """A copy (``copy.deepcopy``, pickling) stores its own parameters' gradients as well.

        ``load_state_dict`` calls this too, on a set-up optimizer: nothing to set up then.
        """
        settings = state.pop("mixedopt", {})
        super().__setstate__(state)
        if "_grad_storage" in self.__dict__:
            self._workspace.clear()  # its views and aliases hold the replaced state's memory
            return
        self._set_up(
            settings.get("grad_dtype", torch.float16),
            settings.get("max_grad_norm"),
            settings.get("skipped_steps", 0),
        )
        for group in self.param_groups:
            for p in group["params"]:
                self._install(p)

    # ------------------------------------------------------------------ construction

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
        except ValueError:
            self.param_groups.pop()
            raise
        for p in group["params"]:
            self._install(p)

    def _install(self, param: Tensor) -> None:
        # FSDP2 owns the gradients of its sharded parameters; after remove_grad_storage() this
        # optimizer stores no gradient.
        if not is_dtensor(param) and self._release_storage.alive:
            self._grad_storage.install(param, self._held_params)

    def _check_group(self, group: dict[str, Any]) -> None:
        name = type(self).__name__
        for flag in _UNSUPPORTED_FLAGS:
            if group.get(flag):
                raise ValueError(
                    f"mixedopt.{name} does not support {flag}=True; leave it at its default"
                )
        for p in group["params"]:
            if p.dtype != torch.float32:
                raise ValueError(
                    f"mixedopt.{name} got a parameter of dtype {p.dtype}; mixedopt keeps float32 "
                    "master weights, so every parameter must be torch.float32 (keep the model in "
                    "float32 and use torch.autocast for low-precision compute)"
                )
            if p.is_inference():
                raise ValueError(
                    f"mixedopt.{name} got a parameter created under torch.inference_mode(): "
                    "autograd keeps no node to hook for it, and it cannot be updated in place "
                    "outside inference mode; create the parameters outside inference mode"
                )
            self._grad_storage.check_can_manage(p)
        self._check_fused_devices(group)

    @staticmethod
    def _check_fused_devices(group: dict[str, Any]) -> None:
        """Raise torch's error for ``fused=True`` on a device it has no fused kernels for.

        At construction, where torch.optim raises it at the first step: the compiled kernels and
        torch's fused updates run on the same devices.
        """
        if group.get("fused"):
            for p in group["params"]:
                _device_dtype_check_for_fused(p)

    def remove_grad_storage(self) -> None:
        """Stop storing gradients in ``grad_dtype`` for this optimizer's parameters.

        Removes the hooks installed at construction and gives every parameter its true float32
        gradient back: from then on the parameters behave like plain torch parameters, and
        parameters added later are left alone. The optimizer still steps (on float32 gradients).
        A parameter that another mixedopt optimizer also holds keeps its storage until that one
        lets go too. Also done when the optimizer is garbage collected.
        """
        self._release_storage()

    def true_grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` without the storage scale, as a new float32 tensor.

        ``None`` where there is no gradient. It is the gradient of what was backpropagated: after
        ``scaler.scale(loss).backward()`` it still holds GradScaler's loss scale.
        """
        return self._grad_storage.true_grad(param)

    def step_in_backward(self) -> UpdatingBackward:
        """A context in which ``backward()`` updates the weights as it produces the gradients.

        ::

            with optimizer.step_in_backward():
                loss.backward()

        does what ``loss.backward(); optimizer.step(); optimizer.zero_grad()`` does, with the
        same weights and state, but each bucket of gradients (``_packing.budget``; a large
        gradient alone) updates its parameters as soon as backward has stored it, and is freed
        then: the gradients of the whole model are never held. For gradient accumulation, the
        earlier micro-batches run a plain ``loss.backward()`` (their gradients are stored in 16
        bits as usual) and the last one runs in this context.

        When it ends it calls ``step()`` once: that updates the parameters that got no gradient
        in this backward but hold one from earlier micro-batches, runs the step hooks, and is
        what LR schedulers check for. After it every parameter's ``.grad`` is ``None``, so a
        ``step()`` or ``zero_grad()`` that follows does nothing.

        An inf or NaN gradient stops the updates of this backward: the parameters updated
        before it keep their update, the others keep their weights and state, their gradients
        are discarded, a ``RuntimeWarning`` says how many of each, and ``skipped_steps`` counts
        it. Refused with a ``RuntimeError``: ``max_grad_norm`` and GradScaler (both need every
        gradient before the first update; GradScaler is caught at its ``step()``, after the
        backward), DistributedDataParallel and FSDP2 (they own the gradients), parameters
        another mixedopt optimizer holds, and ``remove_grad_storage()``.
        """
        return UpdatingBackward(self)

    # ------------------------------------------------------------------ step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf or NaN (GradScaler's skips included)."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self._skipped_on_host + on_device

    # Excluded from torch.compile (``torch.compile(optimizer.step)`` runs it eagerly, a graph
    # break): dynamo traces parameters as fake tensors without the ``grad_dtype = None`` that
    # lets a float32 parameter hold a 16-bit .grad. ``fused=True`` is the compiled step.
    @torch.compiler.disable(
        reason="mixedopt's step() runs eagerly under torch.compile: its parameters hold 16-bit "
        ".grad tensors that dynamo cannot trace; use fused=True for a compiled step"
    )
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Perform a single optimization step; see the parent class.

        Unscales the stored gradients (storage scale, GradScaler's scale, ``max_grad_norm``
        clipping) and applies the parent's update in float32. The whole step is skipped, weights
        and state untouched, when GradScaler found an inf/NaN or when any gradient is non-finite.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._grad_storage.flush()  # gradients of a backward that ended early
        grad_scale = getattr(self, "grad_scale", None)  # GradScaler's, during its step()
        found_inf = getattr(self, "found_inf", None)
        if self._updated_in_backward:
            self._updated_in_backward = False
            # GradScaler found no gradient: the backward had used them, scaled.
            if found_inf is not None and not torch.is_tensor(found_inf):
                raise grad_scaler_error(self)

        buckets, steps = self._collect()
        if not steps and not buckets:
            return loss
        if not self._warned_changed_in_place and self.grad_dtype == torch.float16:
            self._warn_if_changed_in_place([e for _, entries in steps for e in entries])
        if self._step_entries(steps, grad_scale, found_inf, buckets=buckets):
            return loss

        self._skipped_on_host += 1
        if found_inf is None:  # with GradScaler, skipping is routine: no warning
            warnings.warn(
                f"mixedopt.{type(self).__name__}: a gradient is inf or NaN; the step was "
                f"skipped (weights and state unchanged; {self.skipped_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=_user_stacklevel(),
            )
        return loss

    def _step_entries(
        self,
        steps: list[tuple[dict[str, Any], list[Entry]]],
        grad_scale: Tensor | None,
        found_inf: Tensor | None,
        on_host: bool = False,
        buckets: list[WholeBucket] | None = None,
    ) -> bool:
        """Update each group's entries and ``buckets``; ``False`` where the step is skipped.

        Skipped, nothing changed, when GradScaler's ``found_inf`` is set or a gradient is inf
        or NaN. Fused steps on an accelerator decide that on the device (and return ``True``)
        unless ``on_host``. ``buckets`` take their own path (``BucketSteps``).
        """
        entries = [e for _, group_entries in steps for e in group_entries]
        skips, factors = [], None
        if entries:
            factors, skip = self._factors_and_skip(entries, grad_scale, found_inf)
            skips.append(skip)
        if buckets:
            unscale, skip = self._bucket_factors_and_skip(buckets, grad_scale, found_inf)
            skips.append(skip)
        skip = skips[0] if len(skips) == 1 else skips[0] | skips[1].to(skips[0].device)
        bucket_groups = set().union(*(bucket.groups for bucket in buckets or ()))
        fused = all(self._fused_ready(group, entries) for group, entries in steps) and all(
            self._fused_ready(self.param_groups[index], []) for index in bucket_groups
        )
        on_device = fused and skip.device.type != "cpu" and not on_host
        # On the CPU reading the flag costs nothing; on an accelerator the fused kernels keep the
        # old values where it is set, without host synchronisation.
        if not on_device and bool(skip):
            return False
        if buckets:
            self._update_buckets(buckets, unscale, skip if on_device else None)
        start = 0
        for group, group_entries in steps:
            assert factors is not None
            group_factors = factors[start : start + len(group_entries)]
            start += len(group_entries)
            if fused:
                device_skip = skip if on_device else None
                self._fused_step_group(group, group_entries, group_factors, device_skip)
            else:
                self._step_group(group, group_entries, group_factors)
        if on_device:
            if self._skipped_on_device is None:
                self._skipped_on_device = torch.zeros((), dtype=torch.int64, device=skip.device)
            self._skipped_on_device += skip
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
            stacklevel=_user_stacklevel(),
        )

    def _collect(
        self, params: list[list[Tensor]] | None = None
    ) -> tuple[list[WholeBucket], list[tuple[dict[str, Any], list[Entry]]]]:
        """What a step updates: the whole buckets, and the other gradients per group.

        Among ``params`` (a list per parameter group; default: all of them).
        """
        buckets, left = self._take_whole_buckets(params)
        if not left:  # every gradient is in a whole bucket (-1: not looked for)
            return buckets, []
        taken = {id(param) for bucket in buckets for param in bucket.params}
        if params is None:
            params = [group["params"] for group in self.param_groups]
        steps = [
            (group, self._entries(chosen, taken))
            for group, chosen in zip(self.param_groups, params, strict=True)
        ]
        return buckets, [(group, entries) for group, entries in steps if entries]

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

    @staticmethod
    def _foreach(group: dict[str, Any], params: list[Tensor]) -> bool | None:
        """The ``foreach`` the functional update gets for a batch of ``params``.

        ``foreach=None`` (the default) takes torch's foreach implementation on a CPU for a batch
        of small tensors (32Ki elements each on average, or fewer), where a dispatch per tensor
        and operation costs more than the temporaries it saves, and leaves the choice to torch
        otherwise (the for-loop implementation on a CPU, foreach on CUDA). Both give the same
        result.
        """
        foreach = group["foreach"]
        if foreach is None and params and params[0].device.type == "cpu":
            elements = sum(map(Tensor.numel, params))
            return elements <= _packing.CPU_SMALL * len(params)
        return foreach

    @staticmethod
    def _fused(group: dict[str, Any], params: list[Tensor]) -> bool:
        """Whether a batch of ``params`` takes the parent's fused implementation.

        A ``fused=True`` group's batch, unless a parameter is not dense: torch's fused kernels
        walk a tensor's memory from its first element to its size, which is right for a dense
        tensor whose gradient and state share its strides (as mixedopt's do). On a strided view
        with gaps (torch 2.13, CPU), ``torch.optim.SGD(fused=True)`` updates other elements
        and writes into the gaps, memory that is not the parameter's. Such a batch takes torch's
        other implementations, and ``fused=True`` steps give such parameters to the compiled
        kernels.
        """
        return bool(group.get("fused")) and _packing.dense(params)

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

    # ------------------------------------------------------------------ per optimizer

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        """Elementwise float32 state tensors the update reads for this group, in order."""
        raise NotImplementedError

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """Create the parent's state for ``param`` on its first step, as the parent does.

        A step counter and zeros for every state key (RMSprop, Adam); SGD overrides it.
        """
        if len(state) != 0:
            return
        # Like torch.optim.Adam(fused=True), a fused optimizer keeps its step on the device.
        device = param.device if group.get("fused") else None
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        for key in self._state_keys(group):
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Tensor | None]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        """Apply the parent's functional update to float32 ``grads`` (slices of the parameters).

        Its fused implementation for a ``fused=True`` group, where the parent has one; with
        ``found_inf`` (a 0-dim float tensor), a fused update that changes nothing where it is
        set.
        """
        raise NotImplementedError

"""The mixed-precision machinery shared by every mixedopt optimizer.

``MixedPrecisionOptimizer`` is a mixin placed before a ``torch.optim`` class. It installs the
gradient storage (``_storage.py``) at construction, and its ``step()`` turns the 16-bit stored
gradients into true float32 gradients (storage scale x loss scale x clip coefficient, one pass) in
bounded slices, handing each slice to the parent's public functional update (``rmsprop()``,
``adam()``, ``sgd()``). An optimizer file only says how its state is created and which functional
to call.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from . import _fused
from ._distributed import full_values, is_dtensor, local
from ._storage import SUPPORTED_GRAD_DTYPES, GradientStorage, abs_max

# Elements of float32 gradient materialised at once by step(): 1 Mi elements = 4 MiB, small enough
# to stay in cache while the update reads it back.
SLICE_ELEMENTS = 1 << 20
# On an accelerator the cost is per launch, not per cache miss: 4 Mi elements = 16 MiB.
ACCELERATOR_SLICE_ELEMENTS = 1 << 22

_UNSUPPORTED_FLAGS = ("capturable", "differentiable")


@dataclass
class _Entry:
    """A parameter with a gradient, as step() sees it."""

    param: Tensor
    grad: Tensor  # p.grad: float16/bfloat16 (scaled) or float32
    storage_scale: Tensor | None  # None: grad holds true values
    known_abs_max: Tensor | None = None  # bound on |true grad| measured by backward, if current
    state: dict[str, Any] = field(default_factory=dict)  # the optimizer's state for param
    # When param, grad and every state tensor are dense in the same layout, 1-D views of them
    # in storage order, which step() cuts into slices; else the tensors themselves, taken whole.
    splittable: bool = False
    param_view: Tensor | None = None
    grad_view: Tensor | None = None
    state_views: list[Tensor] = field(default_factory=list)
    # State the functional creates on the first step (SGD's momentum buffer): where it goes.
    created_state: dict[str, Tensor] = field(default_factory=dict)

    def plan(self, keys: list[str], state: dict[str, Any]) -> None:
        # A sharded (DTensor) parameter is updated through its rank's shard.
        param, grad = local(self.param), local(self.grad)
        tensors = [local(state.get(key, self.created_state.get(key))) for key in keys]
        order = _dense_order(param)
        if order is not None:
            views = [_flat(t, order) for t in (param, *tensors)]
            if all(v is not None for v in views):
                self.splittable = True
                self.param_view, *self.state_views = views
                # A view when the gradient has the param's layout, else a copy in that layout.
                self.grad_view = grad.permute(order).reshape(-1)
                return
        self.param_view, self.grad_view, self.state_views = param, grad, tensors

    def unscaled(self, value: Tensor) -> Tensor:
        """``value`` (a factor or a norm of ``grad``) with the storage scale taken out."""
        return value if self.storage_scale is None else value / self.storage_scale

    def piece(self, t: Tensor, start: int, stop: int) -> Tensor:
        return t[start:stop] if self.splittable else t


def _dense_order(t: Tensor) -> tuple[int, ...] | None:
    """Dimension order (outermost first) in which ``t`` is contiguous; None if not dense."""
    order = tuple(sorted(range(t.dim()), key=lambda d: -t.stride(d)))
    return order if t.permute(order).is_contiguous() else None


def _flat(t: Tensor, order: tuple[int, ...]) -> Tensor | None:
    """A 1-D view of ``t`` in storage order, or None when ``t`` is not dense in ``order``."""
    permuted = t.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def _l2_norm(grad: Tensor) -> Tensor:
    """L2 norm in float32, slice by slice: no float32 copy of a whole large gradient."""
    order = _dense_order(grad)
    # A sharded (DTensor) gradient: its own norm, a value to be reduced over ranks (full_values).
    if order is None or grad.numel() <= SLICE_ELEMENTS or is_dtensor(grad):
        return torch.linalg.vector_norm(grad, dtype=torch.float32)
    flat = _flat(grad, order)
    parts = [
        torch.linalg.vector_norm(flat[start : start + SLICE_ELEMENTS], dtype=torch.float32)
        for start in range(0, flat.numel(), SLICE_ELEMENTS)
    ]
    return torch.linalg.vector_norm(torch.stack(parts))


def _slices(
    sizes: Sequence[tuple[int, bool]], capacity: int
) -> Iterator[list[tuple[int, int, int]]]:
    """Group ``(numel, splittable)`` items into batches of at most ``capacity`` elements.

    Yields lists of ``(item, start, stop)``; a splittable item may be cut across batches, an
    unsplittable one is never cut (and is a batch of its own when larger than ``capacity``).
    """
    batch: list[tuple[int, int, int]] = []
    filled = 0
    for index, (numel, splittable) in enumerate(sizes):
        if not splittable:
            if batch and filled + numel > capacity:
                yield batch
                batch, filled = [], 0
            batch.append((index, 0, numel))
            filled += numel
            continue
        start = 0
        while True:
            take = min(numel - start, capacity - filled)
            if take <= 0 and start < numel:  # full (or past full, after a large whole item)
                yield batch
                batch, filled = [], 0
                continue
            batch.append((index, start, start + take))
            filled += take
            start += take
            if start == numel:
                break
    if batch:
        yield batch


class MixedPrecisionOptimizer(torch.optim.Optimizer):
    """Float32 master weights and state, 16-bit gradients; mixed into a ``torch.optim`` class.

    At construction every parameter (it must be float32) gets what makes its ``.grad`` land in
    ``grad_dtype`` after ``backward()``, holding the true gradient times a per-tensor power-of-two
    storage scale (``true_grad`` undoes it). ``step()`` upcasts and unscales the gradients in
    bounded slices and applies the parent's float32 update to float32 weights and state.

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
        skipped_steps: steps skipped because a gradient was inf or NaN (GradScaler's included).
            Reading it after fused steps on an accelerator synchronises with the device.
    """

    # GradScaler.step() hands this optimizer its scale and found_inf instead of unscaling 16-bit
    # gradients itself (which it refuses to do).
    _step_supports_amp_scaling = True

    # Set by each optimizer.
    _functional_name: str = ""

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

    def _set_up(
        self, grad_dtype: torch.dtype, max_grad_norm: float | None, skipped_steps: int
    ) -> None:
        self.grad_dtype = grad_dtype
        self.max_grad_norm = max_grad_norm
        self.last_grad_norm: Tensor | None = None
        self._skipped_on_host = skipped_steps
        self._skipped_on_device: Tensor | None = None  # fused steps on an accelerator
        # fused=True: per parameter, the memory its 1-D aliases were made for, and the aliases.
        self._fused_aliases: dict[Tensor, tuple[tuple[int, ...], list[Tensor]]] = {}
        self._grad_storage = GradientStorage(grad_dtype)
        # The storage does not reference the optimizer: it is released when the optimizer dies.
        self._release_storage = weakref.finalize(self, self._grad_storage.release)

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
            self._fused_aliases.clear()  # they hold the replaced state's memory
            return
        self._set_up(
            settings.get("grad_dtype", torch.float16),
            settings.get("max_grad_norm"),
            settings.get("skipped_steps", 0),
        )
        for group in self.param_groups:
            for p in group["params"]:
                if not is_dtensor(p):
                    self._grad_storage.install(p)

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
            if not is_dtensor(p):  # FSDP2 owns the gradients of its sharded parameters
                self._grad_storage.install(p)

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
            self._grad_storage.check_can_manage(p)

    def remove_grad_storage(self) -> None:
        """Stop storing gradients in ``grad_dtype``.

        Removes the hooks installed at construction and gives every parameter its true float32
        gradient back: from then on the parameters behave like plain torch parameters. The
        optimizer still steps (on float32 gradients). Also done when the optimizer is garbage
        collected.
        """
        self._release_storage()

    def true_grad(self, param: Tensor) -> Tensor | None:
        """The gradient of ``param`` without the storage scale, as a new float32 tensor.

        ``None`` where there is no gradient. It is the gradient of what was backpropagated: after
        ``scaler.scale(loss).backward()`` it still holds GradScaler's loss scale.
        """
        return self._grad_storage.true_grad(param)

    # ------------------------------------------------------------------ step

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient was inf or NaN (GradScaler's skips included)."""
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device.item())
        return self._skipped_on_host + on_device

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

        entries = [self._collect(group) for group in self.param_groups]
        if not any(entries):
            return loss
        found_inf = getattr(self, "found_inf", None)
        unscale, skip = self._unscale_and_skip(
            [e for group in entries for e in group], getattr(self, "grad_scale", None), found_inf
        )
        steps = [(g, e) for g, e in zip(self.param_groups, entries, strict=True) if e]

        fused = all(self._fused_ready(group, group_entries) for group, group_entries in steps)
        if fused and skip.device.type != "cpu":
            # No host synchronisation: the kernels keep the old values where skip is set.
            for group, group_entries in steps:
                self._fused_step_group(group, group_entries, unscale, skip)
            if self._skipped_on_device is None:
                self._skipped_on_device = torch.zeros((), dtype=torch.int64, device=skip.device)
            self._skipped_on_device += skip
            return loss
        if not bool(skip):  # on the CPU, reading the flag costs nothing
            for group, group_entries in steps:
                if fused:
                    self._fused_step_group(group, group_entries, unscale, None)
                else:
                    self._step_group(group, group_entries, unscale)
            return loss

        self._skipped_on_host += 1
        if found_inf is None:  # with GradScaler, skipping is routine: no warning
            warnings.warn(
                f"mixedopt.{type(self).__name__}: a gradient is inf or NaN; the step was "
                f"skipped (weights and state unchanged; {self.skipped_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=3,
            )
        return loss

    def _collect(self, group: dict[str, Any]) -> list[_Entry]:
        name = type(self).__name__
        found = []
        for p in group["params"]:
            grad = p.grad
            if grad is None:
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
            storage = self._grad_storage
            found.append(_Entry(p, grad, storage.scale_of(p), storage.known_abs_max(p)))
        return found

    def _unscale_and_skip(
        self, entries: list[_Entry], grad_scale: Tensor | None, found_inf: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The factor shared by all gradients (1/loss scale x clip coefficient) and the skip flag.

        Both are 0-dim tensors on the first parameter's device, computed without host
        synchronisation. With ``max_grad_norm`` it also records ``last_grad_norm``, the L2 norm
        of all true gradients before clipping, computed as ``clip_grad_norm_`` does.
        """
        device = entries[0].param.device
        unscale = torch.ones((), dtype=torch.float32, device=device)
        skip = torch.zeros((), dtype=torch.bool, device=device)
        if grad_scale is not None:
            unscale = grad_scale.to(device=device, dtype=torch.float32).reciprocal()
        if found_inf is not None:  # GradScaler checked every gradient already
            skip = found_inf.to(device) > 0
        if self.max_grad_norm is not None:
            norms = full_values(e.unscaled(_l2_norm(e.grad)) for e in entries)
            norms = [norm.to(device) for norm in norms]
            total = torch.linalg.vector_norm(torch.stack(norms) * unscale)
            self.last_grad_norm = total
            skip = skip | ~torch.isfinite(total)
            unscale = unscale * torch.clamp(self.max_grad_norm / (total + 1e-6), max=1.0)
        elif found_inf is None:
            # Backward measured most gradients already: only the others are read here.
            amax = full_values(
                abs_max(e.grad) if e.known_abs_max is None else e.known_abs_max for e in entries
            )
            skip = ~torch.stack([a.to(device) for a in amax]).isfinite().all()
        return unscale, skip

    def _step_group(self, group: dict[str, Any], entries: list[_Entry], unscale: Tensor) -> None:
        keys = self._state_keys(group)
        by_device: dict[torch.device, list[_Entry]] = {}
        for e in entries:
            # Like the parent, an optimizer with no state (SGD without momentum) records none.
            if keys:
                e.state = self.state[e.param]
                self._init_state(e.param, group, e.state)
            for key in keys:
                if e.state.get(key) is None:
                    e.created_state[key] = torch.empty_like(e.param)
            e.plan(keys, e.state)
            by_device.setdefault(e.param.device, []).append(e)
        for device, device_entries in by_device.items():
            self._step_slices(group, device_entries, keys, unscale.to(device))
        for e in entries:
            e.state.update(e.created_state)

    def _step_slices(
        self, group: dict[str, Any], entries: list[_Entry], keys: list[str], unscale: Tensor
    ) -> None:
        """Upcast and unscale the gradients slice by slice, and update each slice."""
        sizes = [(e.param_view.numel(), e.splittable) for e in entries]
        largest_whole = max((n for n, splittable in sizes if not splittable), default=0)
        per_slice = SLICE_ELEMENTS if unscale.device.type == "cpu" else ACCELERATOR_SLICE_ELEMENTS
        capacity = max(min(per_slice, sum(n for n, _ in sizes)), largest_whole)
        buffer = torch.empty(capacity, dtype=torch.float32, device=unscale.device)
        factors = [e.unscaled(unscale) for e in entries]
        for batch in _slices(sizes, per_slice):
            params: list[Tensor] = []
            grads: list[Tensor] = []
            states: dict[str, list[Tensor | None]] = {key: [] for key in keys}
            steps: list[Tensor] = []
            created: list[tuple[Tensor, list[Tensor | None], int]] = []
            filled = 0
            for i, start, stop in batch:
                e = entries[i]
                grad = e.piece(e.grad_view, start, stop)
                out = buffer[filled : filled + stop - start].view(grad.shape)
                filled += stop - start
                out.copy_(grad).mul_(factors[i])  # upcast, then unscale in float32, in cache
                params.append(e.piece(e.param_view, start, stop))
                grads.append(out)
                for key, view in zip(keys, e.state_views, strict=True):
                    piece = e.piece(view, start, stop)
                    if key in e.created_state:  # the functional creates it: copied in below
                        created.append((piece, states[key], len(states[key])))
                        states[key].append(None)
                    else:
                        states[key].append(piece)
                step = e.state.get("step")
                if step is not None:
                    # The counter advances once per parameter: earlier slices advance a copy.
                    steps.append(step if stop == e.param_view.numel() else step.clone())
            self._update(group, params, grads, states, steps)
            for destination, values, position in created:
                destination.copy_(values[position])

    # ------------------------------------------------------------------ fused=True

    def _fused_ready(self, group: dict[str, Any], entries: list[_Entry]) -> bool:
        """Whether this group steps with the compiled kernels now.

        Only once every parameter has its state: the first step runs the default path, which
        creates the state exactly as the parent does (and skips without creating any).
        """
        if not group.get("fused") or not _fused.available():
            return False
        keys = self._state_keys(group)
        return all(key in self.state.get(e.param, {}) for e in entries for key in keys)

    def _fused_step_group(
        self, group: dict[str, Any], entries: list[_Entry], unscale: Tensor, skip: Tensor | None
    ) -> None:
        """Update ``entries`` with the compiled kernels, ``CHUNK`` parameters per call.

        ``skip`` is None on the CPU (the caller does not step when a gradient is inf/NaN).
        """
        keys = self._state_keys(group)
        # maximize: the kernels get the negated gradient, as torch's update negates it.
        signed_unscale = -unscale if group["maximize"] else unscale
        steps = []
        for e in entries:
            state = self.state[e.param]
            step = state.get("step")
            if step is not None and step.device != e.param.device:
                step = state["step"] = step.to(e.param.device)  # from a non-fused checkpoint
            steps.append(step)
        coefficients = self._fused_coefficients(group, steps)
        per_param = []  # each parameter's kernel arguments, in the kernel's order
        for e, step, step_coefficients in zip(entries, steps, coefficients, strict=True):
            param, grad, states = self._fused_tensors(e, keys, self.state[e.param])
            views = dict(zip(keys, states, strict=True))
            factor = e.unscaled(signed_unscale)
            if factor.device != param.device:
                factor = factor.to(param.device)
            per_param.append(
                (
                    param,
                    grad,
                    factor,
                    step,
                    *[views.get(key) for key in self._fused_state_order],
                    *step_coefficients,
                )
            )
        hyperparameters = self._fused_hyperparameters(group)
        # A group may hold parameters on several devices: a chunk is on one, with its skip flag.
        by_device: dict[torch.device, list[int]] = {}
        for i, e in enumerate(entries):
            by_device.setdefault(e.param.device, []).append(i)
        done = [False] * len(entries)
        for device, indices in by_device.items():
            shared = (None if skip is None else skip.to(device), *hyperparameters)
            for positions in _fused.chunks([per_param[i] for i in indices]):
                chunk = [indices[position] for position in positions]
                if not _fused.run(self._fused_each, [per_param[i] for i in chunk], shared):
                    # No compiler: what is left of the step takes the default path.
                    if skip is None or not bool(skip):
                        rest = [e for e, ran in zip(entries, done, strict=True) if not ran]
                        self._step_group(group, rest, unscale)
                    return
                for i in chunk:
                    done[i] = True

    def _fused_tensors(
        self, e: _Entry, keys: list[str], state: dict[str, Any]
    ) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Parameter, gradient and state as the kernels take them: 1-D when dense."""
        tensors = [e.param, *(state[key] for key in keys)]
        if (
            all(t.is_contiguous() for t in tensors)
            and e.grad.is_contiguous()
            and not is_dtensor(e.param)
        ):
            # The aliases of weights and state are kept while they stay on the same memory.
            memory = (e.param.numel(), *(t.data_ptr() for t in tensors))
            cached = self._fused_aliases.get(e.param)
            if cached is None or cached[0] != memory:
                cached = self._fused_aliases[e.param] = (
                    memory,
                    [_fused.flat_alias(t) for t in tensors],
                )
            param, *states = cached[1]
            return param, _fused.flat_alias(e.grad), states
        e.plan(keys, state)
        param, grad, states = e.param_view, e.grad_view, e.state_views
        if e.splittable:
            param, grad, *states = [_fused.flat_alias(t) for t in (param, grad, *states)]
        # Compiled code must not see the parameter's 16-bit .grad.
        return param.detach(), grad, states

    # ------------------------------------------------------------------ per optimizer

    # The compiled update over a chunk of parameters (``_fused.py``), its state arguments in
    # order, and the arguments the group shares.
    _fused_each: Callable[..., None]
    _fused_state_order: tuple[str, ...] = ()

    def _fused_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]:
        raise NotImplementedError

    def _fused_coefficients(
        self, group: dict[str, Any], steps: list[Tensor | None]
    ) -> list[tuple[Tensor, ...]]:
        """Per-parameter coefficients that depend on its step counter (Adam's bias corrections)."""
        return [()] * len(steps)

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
    ) -> None:
        """Apply the parent's functional update to float32 ``grads`` (slices of the parameters)."""
        raise NotImplementedError

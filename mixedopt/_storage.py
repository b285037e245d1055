"""Gradient storage: makes each ``.grad`` of a float32 parameter land in a 16-bit dtype.

What ``p.grad`` holds
    After ``backward()``, ``p.grad`` is ``grad_dtype`` and holds the true gradient times a
    per-tensor *storage scale*: a power of two, chosen when the gradient is stored, that puts the
    largest magnitude in ``[2**7, 2**8)``. Powers of two are exact to apply and to undo, so the
    only error is the 16-bit rounding of each element, whatever the magnitude of the gradient
    (1e-9 or 1e6) and the loss scale. ``GradientStorage.true_grad(p)`` gives the fp32 gradient.

How it gets there (PyTorch >= 2.10)
    * ``p.grad_dtype = None`` lets autograd accept a ``.grad`` whose dtype differs from ``p``.
    * A post-accumulate-grad hook turns the fp32 gradient of the first ``backward()`` into a
      scaled 16-bit tensor.
    * A pre-hook on the parameter's ``AccumulateGrad`` node handles further ``backward()`` calls
      (gradient accumulation): it picks a scale that fits old and new gradient, rescales the
      stored tensor in place and scales the incoming fp32 gradient, which autograd then adds in
      place into the 16-bit ``.grad`` (computed in fp32, rounded once). A node hook, not a
      tensor hook: tensor hooks also run for ``torch.autograd.grad`` and would scale its result.

A gradient assigned by hand (``p.grad = g``) is taken as the true gradient (scale 1); one changed
in place (``zero_grad(set_to_none=False)``, ``p.grad.mul_(...)``) keeps its scale. All of this is
device work on 0-dim tensors: no host synchronisation on CUDA.
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ._distributed import ddp_managed, process_group_exists

SUPPORTED_GRAD_DTYPES = (torch.float16, torch.bfloat16)

# The stored tensor's largest magnitude lands in [2**(E-1), 2**E): 256x headroom below float16's
# largest value, and 2**-22 of it still a normal float16 number.
_TARGET_EXPONENT = 8
# Keeps the scale and its inverse finite, normal float32 numbers.
_MAX_SCALE_EXPONENT = 126

# Parameters managed by a live GradientStorage: one storage per parameter.
_managed: WeakIdKeyDictionary = WeakIdKeyDictionary()


def power_of_two_scale(amax: Tensor) -> Tensor:
    """Return ``2**k`` with ``amax * 2**k`` in ``[2**7, 2**8)`` (``2**8`` for a zero ``amax``).

    A non-finite ``amax`` gives a scale that keeps the stored tensor non-finite, so that ``step()``
    sees it.
    """
    _, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    k = (_TARGET_EXPONENT - exponent).clamp_(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    return torch.ldexp(torch.ones_like(amax), k)


def abs_max(t: Tensor) -> Tensor:
    """Largest magnitude of ``t`` as a 0-dim float32 tensor (0 for an empty tensor).

    inf or NaN anywhere in ``t`` gives inf or NaN. ``aminmax`` is used because it is many times
    faster on CPU than an inf-norm or ``abs().max()``.
    """
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low).float()


class _Slot:
    """What the storage knows about one parameter's ``.grad``."""

    __slots__ = (
        "param",
        "accumulator",
        "handles",
        "original_grad_dtype",
        "scale",
        "amax",
        "grad_ref",
        "grad_version",
        "engine_owned",
    )

    def __init__(self, param: Tensor) -> None:
        self.param = param
        # Holding the AccumulateGrad node keeps it (and the hook on it) alive between backwards.
        self.accumulator: Any = param.view_as(param).grad_fn.next_functions[0][0]
        self.handles: list[Any] = []
        self.original_grad_dtype = param.grad_dtype
        one = torch.ones((), dtype=torch.float32, device=param.device)
        self.scale: Tensor = one  # p.grad == true gradient * scale, when p.grad is ours
        self.amax: Tensor = one  # upper bound of |true gradient| in p.grad
        self.grad_ref: weakref.ref[Tensor] | None = None  # the .grad tensor this storage wrote
        self.grad_version = -1  # its version counter when written
        self.engine_owned = False  # a distributed engine reads the gradient: left float32

    def owns(self, grad: Tensor) -> bool:
        return self.grad_ref is not None and self.grad_ref() is grad

    def sync(self, grad: Tensor) -> None:
        """Bring ``scale`` and ``amax`` up to date with ``grad`` (the current ``p.grad``)."""
        if not self.owns(grad):  # assigned by hand, or fresh from autograd: true values
            self.scale = torch.ones_like(self.scale)
            self.amax = abs_max(grad)
        elif grad._version != self.grad_version:  # changed in place: same scale, new values
            self.amax = abs_max(grad) / self.scale

    def record(self, grad: Tensor) -> None:
        self.grad_ref = weakref.ref(grad)
        self.grad_version = grad._version


class GradientStorage:
    """Keeps the ``.grad`` of the parameters it manages in ``grad_dtype`` with a storage scale.

    It holds no reference to the optimizer that owns it. ``release()`` removes its hooks and gives
    every managed parameter its true float32 gradient back.
    """

    def __init__(self, grad_dtype: torch.dtype) -> None:
        self.grad_dtype = grad_dtype
        self._slots: dict[int, _Slot] = {}
        self._engines_checked = False

    def __contains__(self, param: Tensor) -> bool:
        return id(param) in self._slots

    def check_can_manage(self, param: Tensor) -> None:
        owner = _managed.get(param)
        if owner is not None and owner is not self:
            raise ValueError(
                "a parameter is already managed by another mixedopt optimizer; a parameter can "
                "belong to one mixedopt optimizer at a time (call remove_grad_storage() on the "
                "other one first)"
            )

    def install(self, param: Tensor) -> None:
        """Make ``param.grad`` land in ``grad_dtype`` (frozen parameters are left alone)."""
        if param in self or not param.requires_grad:
            return
        self.check_can_manage(param)
        slot = _Slot(param)
        param.grad_dtype = None  # accept a .grad whose dtype differs from the parameter's
        slot.handles.append(slot.accumulator.register_prehook(self._pre_accumulate_hook(slot)))
        slot.handles.append(
            param.register_post_accumulate_grad_hook(self._post_accumulate_hook(slot))
        )
        self._slots[id(param)] = slot
        _managed[param] = self

    def _leave_to_engines(self) -> None:
        """Leave float32 the gradients of the parameters a DistributedDataParallel reduces.

        Its reducer reads each gradient right after our post-accumulate hook and accepts only
        the parameter's dtype. Looked up once, at the first backward with a process group.
        """
        if not process_group_exists():
            return
        self._engines_checked = True
        taken = ddp_managed(slot.param for slot in self._slots.values())
        for param in taken:
            slot = self._slots[id(param)]
            slot.engine_owned = True
            param.grad_dtype = slot.original_grad_dtype
        if taken:
            warnings.warn(
                f"mixedopt: {len(taken)} parameter(s) are reduced by "
                "torch.nn.parallel.DistributedDataParallel, which needs float32 gradients and "
                "keeps its own float32 copy of them; their gradients stay float32 (no memory "
                "saved). Call remove_grad_storage() after creating the optimizer to say so and "
                "silence this warning.",
                UserWarning,
                stacklevel=2,
            )

    def _pre_accumulate_hook(self, slot: _Slot):  # noqa: ANN202 - autograd hook
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[Tensor, ...] | None:
            if slot.engine_owned:
                return None
            incoming = grad_outputs[0]
            stored = slot.param.grad
            if stored is None or incoming is None or stored.is_sparse or incoming.is_sparse:
                return None  # nothing stored yet: the post-accumulate hook stores it
            slot.sync(stored)
            bound = slot.amax + abs_max(incoming)
            new_scale = power_of_two_scale(bound)
            stored.mul_(new_scale / slot.scale)  # a power of two: exact
            slot.scale, slot.amax = new_scale, bound
            return (incoming * new_scale,)

        return hook

    def _post_accumulate_hook(self, slot: _Slot):  # noqa: ANN202 - autograd hook
        def hook(param: Tensor) -> None:
            if not self._engines_checked:
                self._leave_to_engines()
            if slot.engine_owned:
                return
            grad = param.grad
            if grad is None or grad.is_sparse:
                return  # step() refuses sparse gradients with a clear error
            if grad.dtype != self.grad_dtype:
                slot.sync(grad)
                new_scale = power_of_two_scale(slot.amax)
                stored = torch.empty_like(grad, dtype=self.grad_dtype)
                # Scale in float32 and round to grad_dtype: one pass.
                torch.mul(grad, new_scale / slot.scale, out=stored)
                param.grad = stored
                slot.scale = new_scale
            slot.record(param.grad)

        return hook

    def scale_of(self, param: Tensor) -> Tensor | None:
        """The storage scale of ``param.grad`` (``None`` where it holds true values)."""
        slot = self._slots.get(id(param))
        grad = param.grad
        if slot is None or grad is None or not slot.owns(grad):
            return None
        return slot.scale

    def known_abs_max(self, param: Tensor) -> Tensor | None:
        """A bound on ``|true gradient|`` of ``param`` known without reading ``param.grad``.

        Measured when backward stored the gradient (inf or NaN there makes it inf or NaN);
        ``None`` when ``p.grad`` was assigned or changed since.
        """
        slot = self._slots.get(id(param))
        grad = param.grad
        if (
            slot is None
            or grad is None
            or not slot.owns(grad)
            or grad._version != slot.grad_version
        ):
            return None
        return slot.amax

    def true_grad(self, param: Tensor) -> Tensor | None:
        """The true gradient of ``param`` as a new float32 tensor (``None`` where it has none)."""
        grad = param.grad
        if grad is None:
            return None
        scale = self.scale_of(param)
        true = grad.to(torch.float32, copy=True)
        return true if scale is None else true.div_(scale)

    def release(self) -> None:
        """Remove every hook; managed parameters get their true fp32 gradient back."""
        for slot in self._slots.values():
            for handle in slot.handles:
                handle.remove()
            param = slot.param
            if param.grad is not None and not param.grad.is_sparse and not slot.engine_owned:
                param.grad = self.true_grad(param).to(param.dtype)
            param.grad_dtype = slot.original_grad_dtype
            if _managed.get(param) is self:
                del _managed[param]
        self._slots.clear()

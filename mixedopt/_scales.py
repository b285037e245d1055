"""Per-tensor scale arithmetic: the power of two a float16 gradient is stored with.

``power_of_two_scale`` puts a tensor's largest magnitude (``abs_max``) in ``[2**7, 2**8)``;
powers of two are exact to apply and to undo, so a stored gradient's only error is its 16-bit
rounding (``_storage.py`` says where the scales are kept). Each has an ``_on_host`` twin giving
the same result from a value read on the host, for a gradient on a CPU (``_store_alone``). Pure
functions of tensors: the step (``_core.py``) measures gradients with ``abs_max`` too.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

# The stored tensor's largest magnitude lands in [2**(E-1), 2**E): 256x headroom below float16's
# largest value, and 2**-22 of it still a normal float16 number.
_TARGET_EXPONENT = 8
# Keeps the scale and its inverse finite, normal float32 numbers.
_MAX_SCALE_EXPONENT = 126


def power_of_two_scale(amax: Tensor) -> Tensor:
    """Return ``2**k`` with ``amax * 2**k`` in ``[2**7, 2**8)`` (``2**8`` for a zero ``amax``).

    Elementwise, for one or many tensors. A non-finite ``amax`` gives a scale that keeps the
    stored tensor non-finite, so that ``step()`` sees it.
    """
    _, exponent = torch.frexp(amax)  # amax = mantissa * 2**exponent, mantissa in [0.5, 1)
    k = (_TARGET_EXPONENT - exponent).clamp_(-_MAX_SCALE_EXPONENT, _MAX_SCALE_EXPONENT)
    # 2.0**k is exact for these k (torch.ldexp is computed the same way).
    return torch.pow(2.0, k).to(amax.dtype)


def power_of_two_scale_on_host(amax: float) -> float:
    """``power_of_two_scale`` of one float32 value read on the host (the same scale, bitwise)."""
    _, exponent = math.frexp(amax)  # (nan or inf, 0) for nan and inf, as torch.frexp gives
    k = min(max(_TARGET_EXPONENT - exponent, -_MAX_SCALE_EXPONENT), _MAX_SCALE_EXPONENT)
    return math.ldexp(1.0, k)


def abs_max_on_host(t: Tensor) -> float:
    """``abs_max(t)`` read on the host, as a Python float."""
    if t.numel() == 0:
        return 0.0
    low, high = (value.item() for value in torch.aminmax(t))
    return max(-low, high)  # a NaN anywhere makes both NaN, and max() keeps it


def abs_max(t: Tensor) -> Tensor:
    """Largest magnitude of ``t`` as a 0-dim float32 tensor (0 for an empty tensor).

    inf or NaN anywhere in ``t`` gives inf or NaN. ``aminmax`` is used because it is many times
    faster on CPU than an inf-norm or ``abs().max()``.
    """
    if t.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=t.device)
    low, high = torch.aminmax(t)
    return torch.maximum(high, -low).float()

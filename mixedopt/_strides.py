"""Sizes and strides: which layouts are dense, and 1-D views of dense tensors.

Pure functions of a tensor's sizes and strides (no state): the layout a copy of a tensor takes,
whether it is dense in some order of its dimensions, and views of it in storage order.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def dense_strides(t: Tensor) -> tuple[int, ...]:
    """The layout a copy of ``t`` should take: its own where dense, else row-major.

    Dense: its elements fill ``numel`` consecutive places, in any dimension order
    (channels_last, say). Pure Python on sizes and strides: no operation is dispatched.
    """
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda d: d[1]):
        if size == 1:
            continue
        if stride != expected:
            return contiguous_strides(t.shape)
        expected *= size
    return tuple(t.stride())


def dense_order(t: Tensor) -> tuple[int, ...] | None:
    """Dimension order (outermost first) in which ``t`` is contiguous; None if not dense."""
    if t.is_contiguous():  # the common case, without a permuted view
        return tuple(range(t.dim()))
    strides = t.stride()
    order = tuple(sorted(range(t.dim()), key=lambda d: -strides[d]))
    return order if t.permute(order).is_contiguous() else None


def dense(tensors: Sequence[Tensor]) -> bool:
    """Whether every tensor of ``tensors`` is dense: contiguous in some order of its dimensions.

    Torch's fused kernels need it (``_choice.implementation``).
    """
    return all(map(Tensor.is_contiguous, tensors)) or all(
        dense_order(t) is not None for t in tensors
    )


def flat_view(t: Tensor, order: tuple[int, ...]) -> Tensor | None:
    """A 1-D view of ``t`` in storage order, or None when ``t`` is not dense in ``order``."""
    if order == tuple(range(t.dim())):  # the common case, without a permuted view
        return t.view(-1) if t.is_contiguous() else None
    permuted = t.permute(order)
    return permuted.view(-1) if permuted.is_contiguous() else None


def view_in(buffer: Tensor, offset: int, like: Tensor, strides: tuple[int, ...]) -> Tensor:
    """A view of ``buffer`` at ``offset`` with the shape of ``like`` and the given strides."""
    return buffer.as_strided(like.shape, strides, buffer.storage_offset() + offset)

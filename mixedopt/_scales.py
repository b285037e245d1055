"""Storage scales: the power of two a float16 gradient is stored with, applied and read back.

Pure functions (``power_of_two_scale``, ``abs_max``, with ``_on_host`` twins) and
``StorageScales``, a component of ``_storage.GradientStorage``: the scales of a ``grad_dtype``,
a gradient stored on its own, and the stats tables that undo the scales (``stats_table``).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable

import torch
from torch import Tensor

from ._budget import budget
from ._rows import IndexCache
from ._slots import Slot
from ._strides import dense_order, flat_view

# The stored tensor's largest magnitude lands in [2**(E-1), 2**E): 256x headroom below float16's
# largest value, and 2**-22 of it still a normal float16 number.
_TARGET_EXPONENT = 8
# Keeps the scale and its inverse finite, normal float32 numbers.
_MAX_SCALE_EXPONENT = 126
# Elements of one piece of a large gradient scaled on a CPU (``_scale_into``): 1 MiB of float32,
# which stays in a core's cache between the multiplication and the rounding copy
# (docs/performance.md).
SCRATCH_PIECE = 1 << 18

# The binades of float32: ``_BOUNDS[i]`` is 2**(i - 126), so that the number of bounds at or
# below a magnitude (``bucketize(..., right=True)``, ``bisect_right``) is its binade: 0 below
# 2**-126 (zero and subnormal numbers), 254 from 2**127 on (inf, and NaN, which compares
# below nothing).
_BOUNDS = [math.ldexp(1.0, e) for e in range(-126, 128)]


def _binade_scale(binade: int) -> float:
    # A magnitude of binade i >= 1 is m * 2**(i - 126) with m in [0.5, 1) (frexp's exponent);
    # binade 0 is below that of i = 1, and gets the largest scale.
    k = _TARGET_EXPONENT - (binade - 126)
    return math.ldexp(1.0, min(max(k, -_MAX_SCALE_EXPONENT), _MAX_SCALE_EXPONENT))


# The storage scale of each binade: one table lookup replaces frexp and the arithmetic on its
# exponent (two operations where those take four, each a launch on an accelerator).
_SCALES = [_binade_scale(i) for i in range(len(_BOUNDS) + 1)]
_TABLES: dict[torch.device, tuple[Tensor, Tensor]] = {}


def _tables(device: torch.device) -> tuple[Tensor, Tensor]:
    """``_BOUNDS`` and ``_SCALES`` as float32 tensors on ``device``, made once."""
    found = _TABLES.get(device)
    if found is None:
        found = _TABLES[device] = (
            torch.tensor(_BOUNDS, dtype=torch.float32).to(device),
            torch.tensor(_SCALES, dtype=torch.float32).to(device),
        )
    return found


def power_of_two_scale(amax: Tensor, out: Tensor | None = None) -> Tensor:
    """Return ``2**k`` with ``amax * 2**k`` in ``[2**7, 2**8)``, elementwise, in two operations.

    For float32 magnitudes from ``2**-119`` to ``2**127``; below, ``2**126``, the largest scale
    (zero and subnormal magnitudes included). A non-finite ``amax`` gives a finite scale that
    keeps the stored tensor non-finite, so that ``step()`` sees it (it checks a whole stats
    table for inf and NaN, scales and bounds at once). ``out``: where to write the scales (a
    tensor shaped like ``amax``).
    """
    bounds, scales = _tables(amax.device)
    return torch.take(scales, torch.bucketize(amax, bounds, right=True), out=out)


def power_of_two_scale_on_host(amax: float) -> float:
    """``power_of_two_scale`` of one float32 value read on the host (the same scale, bitwise)."""
    return _SCALES[bisect.bisect_right(_BOUNDS, amax)]


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


def any_non_finite(bounds: Tensor) -> Tensor:
    """Whether a bound of ``bounds`` (magnitudes, none negative) is inf or NaN: a 0-dim bool.

    Three operations, where ``~bounds.isfinite().all()`` takes six: the largest bound (NaN
    propagates) is not below infinity. ``bounds`` has at least one element.
    """
    return ~(bounds.amax() < math.inf)


class StorageScales:
    """The storage scales of one ``grad_dtype``: found, applied, and read back as stats tables.

    A component of ``_storage.GradientStorage``, which owns one per storage.
    """

    def __init__(self, grad_dtype: torch.dtype) -> None:
        self.grad_dtype = grad_dtype
        self._unit_stats: dict[torch.device, Tensor] = {}  # [[1, 0]]: a gradient of true values
        self._indices = IndexCache()  # stats_table's index tensors

    def clear(self) -> None:
        """Forget the index tensors (the storage manages no parameter any more)."""
        self._indices = IndexCache()

    def inverse(self, slots: list[Slot], grads: list[Tensor]) -> list[Tensor]:
        """1 / storage scale of each gradient (1 where it holds true values), 0-dim each."""
        device = grads[0].device
        stats, rows = self.stats_table(
            [
                (slot.stats, slot.row) if slot.owns(g) else (None, 0)
                for slot, g in zip(slots, grads, strict=True)
            ],
            device,
        )
        return list(stats[:, 0].reciprocal().unbind())

    def for_magnitudes(self, amax: Tensor, out: Tensor | None = None) -> Tensor:
        """The storage scale of each gradient of largest magnitude ``amax`` (into ``out``).

        float16 needs one (its range is narrow); bfloat16 has float32's range, so it stores true
        values (scale 1) and code that reads ``p.grad`` sees the gradient itself.
        """
        if self.grad_dtype == torch.float16:
            return power_of_two_scale(amax, out=out)
        return torch.ones_like(amax) if out is None else out.fill_(1.0)

    def for_magnitude_on_host(self, amax: float) -> float:
        """``for_magnitudes`` of one largest magnitude read on the host."""
        return power_of_two_scale_on_host(amax) if self.grad_dtype == torch.float16 else 1.0

    def store_alone(
        self,
        slot: Slot,
        incoming: Tensor,
        previous: Tensor | None,
        scratch: Callable[[int], Tensor],
        taken: bool = False,
    ) -> None:
        """Store one gradient (added to ``previous``) with its own operations.

        ``scratch(elements)`` gives a float32 buffer on the gradient's device (a staging buffer
        the bucket store lends this store). Runs under ``torch.no_grad()`` (the storage's
        ``_store_alone``).

        ``taken``: nothing else holds ``incoming``. A 16-bit gradient of ``grad_dtype`` with
        nothing to add to (one a weight's cast hands over, under ``mixedopt.autocast``) is
        stored as it is, unscaled (``_store_as_is``), and may become ``.grad`` itself; a float32
        one may be scaled in place on a CPU.
        """
        if previous is None and incoming.dtype == self.grad_dtype:
            self._store_as_is(slot, incoming, taken)
            return
        true = incoming.float()
        # Whether ``true`` is this store's to overwrite: a tensor it made, or one nothing else
        # holds (not part of a graph ``backward(create_graph=True)`` builds).
        owned = true is not incoming or (taken and not incoming.requires_grad)
        if previous is not None:
            (inverse,) = self.inverse([slot], [previous])
            true = torch.addcmul(true, previous, inverse)
            owned = True
        param = slot.param
        stored = torch.empty_strided(
            param.shape, slot.grad_strides(), dtype=self.grad_dtype, device=param.device
        )
        if budget(true.device).on_host:
            # Reading a value costs nothing on a CPU: the scale is found on the host, and the
            # gradient scaled in pieces through the staging buffer where that is faster.
            amax = abs_max_on_host(true)
            scale = self.for_magnitude_on_host(amax)
            stats = torch.tensor([[scale, amax]], dtype=torch.float32)
            _scale_into(stored, true, scale, scratch, owned)
        else:
            # Four launches, each writing where the next reads: the largest magnitude into the
            # stats row, the scale beside it (``power_of_two_scale``'s two), the scaled rounding.
            stats = torch.empty((1, 2), dtype=torch.float32, device=true.device)
            if true.numel():
                torch.linalg.vector_norm(true, math.inf, out=stats[0, 1])
            else:  # no largest magnitude (the inf-norm refuses): 0, as ``abs_max`` gives
                stats[0, 1].zero_()
            self.for_magnitudes(stats[0, 1], out=stats[0, 0])
            torch.mul(true, stats[0, 0], out=stored)
        slot.record(stored, stats, 0, stored._version)

    def _store_as_is(self, slot: Slot, incoming: Tensor, taken: bool) -> None:
        """Store a gradient already in ``grad_dtype`` unscaled: its values are the true ones.

        The tensor itself becomes ``.grad`` where it is ``taken`` (nothing else holds it) and
        has the stored layout, as ``AccumulateGrad`` takes a gradient over; else a copy. Not
        read: it is recorded with no stats (``None``, true values), so that ``step()`` checks
        it for inf and NaN where nothing else does; GradScaler's check and clipping's norm read
        it anyway.
        """
        param = slot.param
        strides = slot.grad_strides()
        stored = incoming
        if not (
            incoming.stride() == strides
            and incoming.storage_offset() == 0
            and incoming.untyped_storage().nbytes() == incoming.nbytes
            and taken
            and not incoming.requires_grad  # ``backward(create_graph=True)``: stored detached
        ):
            stored = torch.empty_strided(
                param.shape, strides, dtype=self.grad_dtype, device=param.device
            ).copy_(incoming)
        slot.record(stored, None, 0, stored._version)

    def stats_table(
        self, found: list[tuple[Tensor | None, int]], device: torch.device
    ) -> tuple[Tensor, list[int]]:
        """Rows ``[storage scale, |true gradient| bound]``, one per ``(stats, row)`` in ``found``.

        ``(None, _)`` gives ``[1, 0]``: a gradient holding true values. A fixed number of
        operations, whatever the number of rows: the tables are joined and indexed once.
        """
        tables: dict[int, tuple[int, Tensor]] = {}  # id -> (first row in the join, table)
        unit = self._unit_stats.get(device)
        if unit is None:
            unit = self._unit_stats[device] = torch.tensor([[1.0, 0.0]], device=device)
        joined = 1  # the unit row comes first
        index = []
        for stats, row in found:
            if stats is None:
                index.append(0)
                continue
            first = tables.get(id(stats))
            if first is None:
                first = tables[id(stats)] = (joined, stats)
                joined += stats.shape[0]
            index.append(first[0] + row)
        parts = [unit, *(t.to(device) for _, t in tables.values())]
        positions = self._indices.get(index, device)
        return torch.cat(parts).index_select(0, positions), index


def _scale_into(
    stored: Tensor, true: Tensor, scale: float, scratch: Callable[[int], Tensor], owned: bool
) -> None:
    """``stored = true * scale`` on a CPU, in float32, rounded to ``stored``'s dtype.

    On a CPU a multiplication into a 16-bit output computes into a float32 temporary of the
    whole gradient first, memory that no cache holds. ``owned`` (``true`` is this store's to
    overwrite) and dense (no two elements share memory, as they do in the expanded gradient of
    a sum): ``true`` is scaled where it is, then rounded, in memory the caches still hold from
    the operation that made it. Else, for a gradient of up to ``SCRATCH_PIECE`` elements,
    one multiplication; a larger one's temporary is fresh memory, whose pages the system maps
    at the first write: there a dense gradient is scaled in pieces through ``scratch`` instead
    (the staging buffer, which the next bucket zeroes again), each piece a vectorised
    multiplication and a rounding copy, small enough to stay in a core's cache between the two.
    All round the same float32 products (docs/performance.md).
    """
    if owned and dense_order(true) is not None:
        torch.mul(true, scale, out=true)
        stored.copy_(true)
        return
    size = min(SCRATCH_PIECE, budget(true.device).capacity)
    numel = true.numel()
    order = dense_order(stored) if numel > size else None
    flat_stored = None if order is None else flat_view(stored, order)
    flat_true = None if order is None else flat_view(true, order)
    if flat_stored is None or flat_true is None:
        torch.mul(true, scale, out=stored)  # one pass
        return
    space = scratch(size)
    for start in range(0, numel, size):
        piece = flat_true[start : start + size]
        part = space[: piece.numel()]
        torch.mul(piece, scale, out=part)
        flat_stored[start : start + size].copy_(part)

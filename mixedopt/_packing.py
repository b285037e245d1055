"""Many small tensors worked on as one: a flat buffer of rows, each tensor starting on a row.

Also the per-device ``budget`` (buffer capacity, the largest tensor packed, the step's batch,
whether the device is the host), ``Entry`` (a parameter with a gradient, as ``step()`` sees it)
and ``Workspace`` (the buffers the update paths copy into, kept between steps). See
docs/design.md, "Packing and budgets".
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import repeat
from typing import Any, NamedTuple

import torch
from torch import Tensor

# Elements per row: small enough that padding costs little (a bias of 64 elements fills one),
# large enough that per-row work is a small fraction of per-element work.
ROW = 64

# Elements of float32 in one buffer: 1 Mi elements = 4 MiB on a CPU (it stays in cache while it is
# read back), 4 Mi = 16 MiB on an accelerator (fewer launches).
CPU_CAPACITY = 1 << 20
ACCELERATOR_CAPACITY = 1 << 22
# The largest tensor worked on together with others on a CPU (backward's buckets, fused=True's
# packs, the default step's foreach batches): above it, a tensor's bytes cost more than the few
# dispatches it takes alone.
CPU_SMALL = 1 << 15
# Elements of one batch of the default step on a CPU (a larger parameter is cut into pieces of
# it): the functional update passes over a batch several times and allocates temporaries of its
# size (Adam: two), which are smaller and come back from the allocator warm (docs/performance.md).
CPU_PIECE = 1 << 19
# On an accelerator: the largest gradient backward stores in a bucket with others (a larger one
# is stored alone, in four launches), so that every bucket stored during backward holds three
# gradients at least.
ACCELERATOR_BUCKET_SMALL = 1 << 20
# On an accelerator: the largest parameter fused=True packs (a compiled call costs more than a
# copy of that size).
ACCELERATOR_FUSED_SMALL = 1 << 20
# On an accelerator: elements of one batch of the default step (256 MiB of float32). A batch
# costs a few launches beyond torch's own update whatever its size; at 64 Mi elements they are
# a few percent of the memory time of its update.
ACCELERATOR_BATCH = 1 << 26
# The CPU's budget when set (tests give it an accelerator's, ``accelerator_budget``, to run the
# accelerator path on the CPU); None: the CPU's own, from the limits above.
CPU_BUDGET: Budget | None = None


@dataclass(frozen=True)
class Budget:
    """How much is packed on a device, and what the device is.

    ``capacity``: elements in one bucket, slice or pack (the memory a buffer costs), and the
    largest buffer a ``Workspace`` keeps between steps.
    ``bucket_small``: the largest gradient backward stores in a bucket with others.
    ``fused_small``: the largest parameter ``fused=True`` packs with others (weights, gradient
    and state copied in and out around one compiled call).
    ``piece``: elements in one batch of the default step, a larger parameter cut into 1-D
    pieces of this size.
    ``on_host``: the device is the host (a CPU): a value is read there without synchronising
    with a device, and fresh memory costs the system's page faults at the first write.
    Elsewhere every operation is a kernel launch, and a read a synchronisation.
    """

    capacity: int
    bucket_small: int
    fused_small: int
    piece: int
    on_host: bool


def budget(device: torch.device) -> Budget:
    """The packing budget of ``device`` (read at call time, so that tests can change it)."""
    if device.type == "cpu":
        return CPU_BUDGET or _cpu_budget(CPU_CAPACITY, CPU_SMALL, CPU_PIECE)
    return accelerator_budget(
        ACCELERATOR_CAPACITY, ACCELERATOR_BUCKET_SMALL, ACCELERATOR_FUSED_SMALL, ACCELERATOR_BATCH
    )


# Kept per value of the limits: backward asks for a budget once per gradient stored alone.
@functools.cache
def _cpu_budget(capacity: int, small: int, piece: int) -> Budget:
    small = min(small, capacity)
    return Budget(capacity, small, small, min(piece, capacity), on_host=True)


@functools.cache
def accelerator_budget(capacity: int, bucket_small: int, fused_small: int, batch: int) -> Budget:
    """The budget of an accelerator with these limits (tests give it to the CPU too)."""
    return Budget(
        capacity, min(bucket_small, capacity), min(fused_small, capacity), batch, on_host=False
    )


def rows_for(numel: int) -> int:
    """Rows a tensor of ``numel`` elements takes (a tensor of none takes none)."""
    return -(-numel // ROW)


class RowLayout:
    """Where tensors of the given sizes sit in a buffer of rows, and which tensor each row is."""

    def __init__(self, numels: Sequence[int], device: torch.device) -> None:
        self.numels = tuple(numels)
        rows = [rows_for(n) for n in self.numels]
        self.offsets: list[int] = []  # in elements
        total = 0
        for count in rows:
            self.offsets.append(total * ROW)
            total += count
        self.rows = total
        owners = [i for i, count in enumerate(rows) for _ in range(count)]
        # The tensor of each row, as a column; and the rows of each tensor.
        self.owner = torch.tensor(owners, dtype=torch.int64).reshape(-1, 1).to(device)
        self._owner_pairs: Tensor | None = None  # ``owner`` in a table of pairs (``per_row_first``)
        self.counts = torch.tensor(rows, dtype=torch.int64).to(device)

    @property
    def elements(self) -> int:
        return self.rows * ROW

    def per_row(self, values: Tensor) -> Tensor:
        """``values`` (one per tensor) as a ``(rows, 1)`` column: the value of each row's tensor."""
        return torch.take(values, self.owner)

    def per_row_first(self, pairs: Tensor) -> Tensor:
        """``per_row`` of the first column of ``pairs``, a table of two columns, a row per tensor.

        One operation, where selecting the column first takes two.
        """
        if self._owner_pairs is None:
            self._owner_pairs = self.owner * 2
        return torch.take(pairs, self._owner_pairs)

    def per_tensor_max(self, row_values: Tensor) -> Tensor:
        """The largest of each tensor's rows (0 for a tensor without rows); NaN propagates."""
        return torch.segment_reduce(row_values, "max", lengths=self.counts, unsafe=True, initial=0)


class IndexCache:
    """Lists of positions as index tensors, kept: the same few come back every step."""

    def __init__(self, size: int = 64) -> None:
        self._size = size
        self._found: dict[tuple[torch.device, tuple[int, ...]], Tensor] = {}

    def get(self, positions: Sequence[int], device: torch.device) -> Tensor:
        key = (device, tuple(positions))
        found = self._found.get(key)
        if found is None:
            if len(self._found) >= self._size:
                self._found.clear()
            found = self._found[key] = torch.tensor(key[1], dtype=torch.int64, device=device)
        return found


class LayoutCache:
    """The layouts of the last few size patterns: a training loop repeats the same few.

    Threads storing buckets at once share one (a layout never changes once made): the order of
    use is kept under a lock, a layout is made outside it.
    """

    def __init__(self, size: int = 8) -> None:
        self._size = size
        self._layouts: dict[tuple[tuple[int, ...], torch.device], RowLayout] = {}
        self._lock = threading.Lock()

    def get(self, numels: Sequence[int], device: torch.device) -> RowLayout:
        key = (tuple(numels), device)
        with self._lock:
            layout = self._layouts.pop(key, None)
            if layout is not None:
                self._layouts[key] = layout  # now the most recently used
                return layout
        layout = RowLayout(key[0], device)
        with self._lock:
            if len(self._layouts) >= self._size:
                del self._layouts[next(iter(self._layouts))]  # the least recently used
            return self._layouts.setdefault(key, layout)


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


class ViewRuns:
    """Views of many tensors in one buffer, made with an operation per run rather than per tensor.

    Tensors of one shape and strides at evenly spaced offsets (the same parameter of every
    block of a model, say) form a run: one ``as_strided`` view stacks them and ``unbind`` splits
    it, both in C++. A tensor alone is viewed on its own.
    """

    def __init__(
        self,
        shapes: Sequence[torch.Size],
        strides: Sequence[tuple[int, ...]],
        offsets: Sequence[int],
    ) -> None:
        self.count = len(offsets)
        members: dict[tuple[torch.Size, tuple[int, ...]], list[tuple[int, int]]] = {}
        for i, key in enumerate(zip(shapes, strides, strict=True)):
            members.setdefault(key, []).append((offsets[i], i))
        # (where, count, shape, strides, first offset, spacing) of each run. ``where``: the
        # positions of its tensors, a slice where they are evenly spaced too (a weight every
        # other gradient, say), which puts the run's views in place with one assignment, in C.
        self.runs: list[tuple[list[int] | slice, int, torch.Size, tuple[int, ...], int, int]] = []
        for (shape, stride), found in members.items():
            run = [found[0]]
            for offset, i in found[1:]:
                spacing = run[1][0] - run[0][0] if len(run) > 1 else offset - run[0][0]
                if offset - run[-1][0] != spacing:
                    self._add(run, shape, stride)
                    run = []
                run.append((offset, i))
            self._add(run, shape, stride)

    def _add(self, run: list[tuple[int, int]], shape: torch.Size, strides: tuple[int, ...]) -> None:
        spacing = run[1][0] - run[0][0] if len(run) > 1 else 0
        positions = [i for _, i in run]
        where: list[int] | slice = positions
        if len(positions) > 1:
            first, step = positions[0], positions[1] - positions[0]
            if positions == list(range(first, positions[-1] + 1, step)):
                where = slice(first, positions[-1] + 1, step)
        self.runs.append((where, len(positions), shape, strides, run[0][0], spacing))

    def views(self, buffer: Tensor) -> list[Tensor]:
        """The tensors' views of ``buffer``, in the order they were given."""
        found: list[Any] = [None] * self.count
        start = buffer.storage_offset()
        for where, count, shape, strides, offset, spacing in self.runs:
            if isinstance(where, slice):
                found[where] = buffer.as_strided(
                    (count, *shape), (spacing, *strides), start + offset
                ).unbind(0)
            elif count == 1:
                found[where[0]] = buffer.as_strided(shape, strides, start + offset)
            else:
                stacked = buffer.as_strided((count, *shape), (spacing, *strides), start + offset)
                for position, view in zip(where, stacked.unbind(0), strict=True):
                    found[position] = view
        return found


class StoredRows(NamedTuple):
    """A bucket backward stored: its 16-bit buffer of rows, their layout, and each view's runs.

    ``stored`` is ``layout.rows x ROW``; ``runs`` makes the view of each gradient, in order.
    """

    stored: Tensor
    layout: RowLayout
    runs: ViewRuns


class Entry:
    """A parameter with a gradient, as ``step()`` sees it (one is made per parameter per step)."""

    __slots__ = ("param", "grad", "stats", "row", "amax_current", "sharded", "state", "created")

    def __init__(
        self,
        param: Tensor,
        grad: Tensor,
        stats: Tensor | None,
        row: int,
        amax_current: bool,
        sharded: bool,
    ) -> None:
        self.param = param
        self.grad = grad  # p.grad: float16/bfloat16 (scaled) or float32
        # Row ``row`` of ``stats``: [storage scale, |true gradient| bound]
        # (GradientStorage.stats_of); None: grad holds true values.
        self.stats, self.row = stats, row
        self.amax_current = amax_current  # whether that bound describes grad as it is now
        self.sharded = sharded  # a DTensor (FSDP2): updated through its rank's shard
        self.state: dict[str, Any] = {}  # the optimizer's state for param
        # State the functional creates on the first step (SGD's momentum buffer): where it goes.
        self.created: dict[str, Tensor] = {}


def packs(
    entries: Sequence[Entry], small: int, capacity: int, kind: Callable[[int], Hashable]
) -> tuple[list[list[int]], list[int]]:
    """Indices of the entries to pack, in packs, and of the others.

    An entry is packed when its parameter has at most ``small`` elements and is not sharded.
    Entries of one ``kind(index)`` go together, in order, in packs of at most ``capacity``
    elements (whole rows).
    """
    runs: dict[Hashable, list[list[int]]] = {}
    filled: dict[Hashable, int] = {}
    others = []
    for i, e in enumerate(entries):
        numel = e.param.numel()
        if numel > small or e.sharded:
            others.append(i)
            continue
        k = kind(i)
        elements = rows_for(numel) * ROW
        if k not in runs or filled[k] + elements > capacity:
            runs.setdefault(k, []).append([])
            filled[k] = 0
        runs[k][-1].append(i)
        filled[k] += elements
    return [pack for found in runs.values() for pack in found], others


class Workspace:
    """Buffers kept between steps, per device and role, and views of them.

    A pack copies its parameters' weights, gradients and state into a buffer per role (each at
    most ``capacity`` elements, zero at first, so that padding holds only numbers the update
    keeps finite). The views of a buffer in each parameter's layout are made once and kept: a
    training loop packs the same parameters every step.
    """

    _MAX_VIEWS = 4096

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, str, torch.dtype], Tensor] = {}
        self._views: dict[tuple[Any, ...], Tensor] = {}
        # (buffer key, ids of runs) -> (the runs, the rows of the buffer they take, the rows of
        # each, their views of the buffer)
        self._run_views: dict[
            tuple[Any, ...], tuple[list[ViewRuns], Tensor, list[Tensor], list[Tensor]]
        ] = {}
        self._layouts = LayoutCache()
        self._indices = IndexCache()
        # Per parameter: the memory its 1-D aliases were made for, and the aliases (fused=True).
        self.aliases: dict[int, tuple[tuple[Any, ...], list[Tensor]]] = {}
        self._padding: dict[tuple[Any, ...], list[tuple[Tensor | None, ...]]] = {}

    def clear(self) -> None:
        """Forget every buffer, view and alias (the state was replaced: ``load_state_dict``)."""
        self._buffers.clear()
        self._views.clear()
        self._run_views.clear()
        self.aliases.clear()

    def padding(self, count: int, like: Sequence[Tensor | None]) -> list[tuple[Tensor | None, ...]]:
        """``count`` scratch parameters like ``like`` (a parameter's tensors, ``None`` kept).

        Zeros of 2 elements, each tensor an allocation of its own: compiled code specialises
        on inputs that share memory, and on sizes 0 and 1.
        """
        key = tuple(None if t is None else (t.device, t.dtype) for t in like)
        found = self._padding.setdefault(key, [])
        while len(found) < count:
            found.append(
                tuple(
                    None if t is None else torch.zeros(2, dtype=t.dtype, device=t.device)
                    for t in like
                )
            )
        return found[:count]

    def layout(self, numels: Sequence[int], device: torch.device) -> RowLayout:
        return self._layouts.get(numels, device)

    def index(self, positions: Sequence[int], device: torch.device) -> Tensor:
        """``positions`` as an index tensor on ``device`` (kept: packs repeat every step)."""
        return self._indices.get(positions, device)

    def buffer(self, role: str, dtype: torch.dtype, device: torch.device, elements: int) -> Tensor:
        """The flat buffer of ``role``, at least ``elements`` long.

        Kept between steps, zero at first, up to the device's ``capacity`` elements. A longer
        one (a batch of the default step on an accelerator) is new memory each time, left
        uninitialised, which the allocator takes back once the batch is done (``keeps``): the
        default step reads only the views of gradients it wrote there.
        """
        if not self.keeps(device, elements):
            return torch.empty(elements, dtype=dtype, device=device)
        key = (device, role, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < elements:
            buffer = self._buffers[key] = torch.zeros(elements, dtype=dtype, device=device)
            self._views = {k: v for k, v in self._views.items() if k[0] != key}
            self._run_views = {k: v for k, v in self._run_views.items() if k[0] != key}
        return buffer

    @staticmethod
    def keeps(device: torch.device, elements: int) -> bool:
        """Whether a buffer of ``elements`` is kept between steps, with its views."""
        return elements <= budget(device).capacity

    def run_views(
        self,
        role: str,
        dtype: torch.dtype,
        plans: Sequence[tuple[RowLayout, ViewRuns]],
        device: torch.device,
    ) -> tuple[Tensor, list[Tensor], list[Tensor]]:
        """One buffer of ``role`` for buckets of rows, one after the other, and views of it.

        ``plans`` holds each bucket's layout and the views its ``runs`` make. Returns the
        buffer's rows, each bucket's rows, and every gradient's view, in order.
        """
        elements = sum(layout.elements for layout, _ in plans)
        buffer = self.buffer(role, dtype, device, elements)
        kept = self.keeps(device, elements)
        key = ((device, role, dtype), tuple(id(runs) for _, runs in plans))
        found = self._run_views.get(key) if kept else None
        if found is None or any(
            mine is not runs for mine, (_, runs) in zip(found[0], plans, strict=True)
        ):
            parts, views = [], []
            start = 0
            for layout, runs in plans:
                parts.append(buffer[start : start + layout.elements].view(layout.rows, ROW))
                views += runs.views(buffer[start:])
                start += layout.elements
            rows = buffer[:elements].view(-1, ROW)
            found = ([runs for _, runs in plans], rows, parts, views)
            if kept:
                if len(self._run_views) >= 64:
                    self._run_views.clear()
                self._run_views[key] = found
        return found[1], found[2], found[3]

    def rows(
        self, role: str, dtype: torch.dtype, layout: RowLayout, params: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """The ``(rows, ROW)`` buffer of ``role`` for ``layout``, and views of it for ``params``.

        Each view is at its parameter's offset and in its layout: every role of a pack puts an
        element of a parameter at the same place.
        """
        device = params[0].device
        buffer = self.buffer(role, dtype, device, layout.elements)
        buffer_key = (device, role, dtype)
        rows = buffer[: layout.elements].view(layout.rows, ROW)
        if not self.keeps(device, layout.elements):
            strides = map(dense_strides, params)
            return rows, list(map(view_in, repeat(buffer), layout.offsets, params, strides))
        views = []
        cached = self._views
        for p, offset in zip(params, layout.offsets, strict=True):
            key = (buffer_key, offset, p.shape, p.stride())
            view = cached.get(key)
            if view is None:
                if len(cached) >= self._MAX_VIEWS:
                    cached.clear()
                view = cached[key] = view_in(buffer, offset, p, dense_strides(p))
            views.append(view)
        return rows, views


def by_device(
    entries: list[Entry], factors: Tensor
) -> dict[torch.device, tuple[list[Entry], Tensor]]:
    """``entries`` and their ``factors`` per device of their parameters, in order."""
    devices = {e.param.device for e in entries}
    if devices == {factors.device}:
        return {factors.device: (entries, factors)}
    found: dict[torch.device, tuple[list[Entry], list[int]]] = {}
    for i, e in enumerate(entries):
        found.setdefault(e.param.device, ([], []))
        found[e.param.device][0].append(e)
        found[e.param.device][1].append(i)
    return {
        device: (chosen, factors[torch.tensor(indices, device=factors.device)].to(device))
        for device, (chosen, indices) in found.items()
    }

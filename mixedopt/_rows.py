"""Many small tensors worked on as one: a flat buffer of rows, each tensor starting on a row.

``RowLayout`` (where tensors of given sizes sit, and which tensor each row is) and ``ViewRuns``
(their views, made in runs) are immutable once made, so that threads storing buckets at once
share them; ``LayoutCache`` and ``IndexCache`` keep the few a training loop repeats. See
docs/design.md, "Packing and budgets".
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ._budget import budget

# Elements per row: small enough that padding costs little (a bias of 64 elements fills one),
# large enough that per-row work is a small fraction of per-element work.
ROW = 64


def rows_for(numel: int) -> int:
    """Rows a tensor of ``numel`` elements takes (a tensor of none takes none)."""
    return -(-numel // ROW)


class RowLayout:
    """Where tensors of the given sizes sit in a buffer of rows, and which tensor each row is.

    The rows of each tensor (``counts``, one number per tensor) are a tensor on the device. On
    an accelerator the tensor of each row is a table there too (``per_row`` is one launch, and
    no copy from the host). On the host that index is made when a value per row is, in int32
    (one operation more, and the bytes of reading an int64 table): a layout kept between
    steps holds a number per tensor, not per row.
    """

    def __init__(self, numels: Sequence[int], device: torch.device) -> None:
        self.numels = tuple(numels)
        rows = [rows_for(n) for n in self.numels]
        self.offsets: list[int] = []  # in elements
        total = 0
        for count in rows:
            self.offsets.append(total * ROW)
            total += count
        self.rows = total
        on_host = budget(device).on_host
        self.counts = torch.tensor(rows, dtype=torch.int32 if on_host else torch.int64).to(device)
        # The last row of each tensor that fills it only in part (``zero_padding``).
        self.padded = [
            (offset + n) // ROW
            for offset, n in zip(self.offsets, self.numels, strict=True)
            if n % ROW
        ]
        # An accelerator's tables: the tensor of each row, as a column; ``owner`` in a table of
        # pairs (``per_row_first``); ``padded`` as an index. None on the host.
        self._owner: Tensor | None = None
        self._owner_pairs: Tensor | None = None
        self._padded_index: Tensor | None = None
        if not on_host:
            owners = torch.repeat_interleave(torch.arange(len(rows)), torch.tensor(rows))
            self._owner = owners.reshape(-1, 1).to(device)
            if self.padded:
                self._padded_index = torch.tensor(self.padded, dtype=torch.int64).to(device)

    @property
    def elements(self) -> int:
        return self.rows * ROW

    def _owners(self) -> Tensor:
        """The tensor of each row (the host's ``counts``, int32), made now."""
        return torch.repeat_interleave(self.counts, output_size=self.rows)

    def per_row(self, values: Tensor) -> Tensor:
        """``values`` (one per tensor) as a ``(rows, 1)`` column: the value of each row's tensor."""
        if self._owner is None:
            return values.index_select(0, self._owners()).view(-1, 1)
        return torch.take(values, self._owner)

    def per_row_first(self, pairs: Tensor) -> Tensor:
        """``per_row`` of the first column of ``pairs``, a table of two columns, a row per tensor.

        One operation on an accelerator, where selecting the column first takes two.
        """
        if self._owner is None:  # the column is a view: nothing copied
            return pairs[:, 0].index_select(0, self._owners()).view(-1, 1)
        if self._owner_pairs is None:
            self._owner_pairs = self._owner * 2
        return torch.take(pairs, self._owner_pairs)

    def zero_padding(self, rows: Tensor) -> None:
        """Zero the rows of ``rows`` (``self.rows x ROW``) that a tensor fills only in part.

        Writing each tensor where the layout puts it then leaves no element undefined.
        """
        if not self.padded:  # every tensor fills its rows (sizes multiples of ROW)
            return
        index = self._padded_index
        if index is None:
            index = torch.tensor(self.padded, dtype=torch.int64, device=rows.device)
        rows.index_fill_(0, index, 0)

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

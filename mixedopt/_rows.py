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

# Elements per row: small enough that padding costs little (a bias of 64 elements fills one),
# large enough that per-row work is a small fraction of per-element work.
ROW = 64


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

"""The buffers an optimizer's update copies gradients, weights and state into, for one update.

A ``Workspace`` belongs to one optimizer (its ``step()``, and ``step_in_backward()``'s updates
under that mode's lock): one update at a time uses it, as torch.optim's own state. Its buffers
and their views live until the update ends (``release``); between steps it keeps only what is
sized to the number of parameters, not to their elements (index tables, how views are made).
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Any

import torch
from torch import Tensor

from ._budget import budget
from ._rows import ROW, IndexCache, LayoutCache, RowLayout, ViewRuns
from ._strides import dense_strides, view_in

_shape_of = Tensor.size
_stride_of = Tensor.stride


class Workspace:
    """Buffers of one update, per device and role, and views of them.

    A pack copies its parameters' weights, gradients and state into a buffer per role (each at
    most ``capacity`` elements). The buffers are made by the update's first batch that needs
    them, reused by its next batches, and let go with their views when it ends (``release``),
    as torch.optim's own temporaries are: what stays between steps is bounded by
    ``_budget.HELD_BETWEEN_STEPS`` and ``HELD_PER_TENSOR``. They are new memory, left
    uninitialised: what reads a buffer reads the views written there, and the elementwise
    updates that run over whole rows leave the padding between parameters to itself. How the
    views of a pack's parameters are made (``ViewRuns``, a few operations for all of them, no
    memory) is kept: a training loop packs the same parameters every step.
    """

    _MAX_RUNS = 64

    def __init__(self) -> None:
        self._buffers: dict[tuple[torch.device, str, torch.dtype], Tensor] = {}
        # (shapes, strides) of a pack's parameters -> their views' runs in its layout.
        self._runs: dict[tuple[Any, ...], ViewRuns] = {}
        self._layouts = LayoutCache()
        self._indices = IndexCache()
        # Per parameter: the memory its 1-D aliases were made for, and the aliases (fused=True).
        self.aliases: dict[int, tuple[tuple[Any, ...], list[Tensor]]] = {}
        self._padding: dict[tuple[Any, ...], list[tuple[Tensor | None, ...]]] = {}

    def release(self) -> None:
        """Let go of the buffers (the update ended): the allocator takes them back.

        Dropped, not shrunk in place: a view of a buffer that something still holds (a
        traceback's frame) keeps its memory, and reading it stays safe.
        """
        self._buffers.clear()

    def clear(self) -> None:
        """Forget every buffer and alias (the state was replaced: ``load_state_dict``)."""
        self._buffers.clear()
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
        """The flat buffer of ``role``, at least ``elements`` long, uninitialised.

        Up to the device's ``capacity`` elements it is kept until the update ends, for its next
        batches. A longer one (a batch of the default step on an accelerator) is new memory
        each time, which the allocator takes back once the batch is done.
        """
        if elements > budget(device).capacity:
            return torch.empty(elements, dtype=dtype, device=device)
        key = (device, role, dtype)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < elements:
            buffer = self._buffers[key] = torch.empty(elements, dtype=dtype, device=device)
        return buffer

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
        parts, views = [], []
        start = 0
        for layout, runs in plans:
            parts.append(buffer[start : start + layout.elements].view(layout.rows, ROW))
            views += runs.views(buffer[start:])
            start += layout.elements
        return buffer[:elements].view(-1, ROW), parts, views

    def rows(
        self, role: str, dtype: torch.dtype, layout: RowLayout, params: Sequence[Tensor]
    ) -> tuple[Tensor, list[Tensor]]:
        """The ``(rows, ROW)`` buffer of ``role`` for ``layout``, and views of it for ``params``.

        Each view is at its parameter's offset and in its layout: every role of a pack puts an
        element of a parameter at the same place.
        """
        device = params[0].device
        buffer = self.buffer(role, dtype, device, layout.elements)
        rows = buffer[: layout.elements].view(layout.rows, ROW)
        if layout.elements > budget(device).capacity:  # a batch of its own: views one by one
            strides = map(dense_strides, params)
            return rows, list(map(view_in, repeat(buffer), layout.offsets, params, strides))
        # The shapes and strides give the layout (its sizes) and the runs: one key, read in C.
        key = (tuple(map(_shape_of, params)), tuple(map(_stride_of, params)))
        runs = self._runs.get(key)
        if runs is None:
            if len(self._runs) >= self._MAX_RUNS:
                self._runs.clear()
            runs = self._runs[key] = ViewRuns(
                [p.shape for p in params], [dense_strides(p) for p in params], layout.offsets
            )
        return rows, runs.views(buffer)

"""The buffers an optimizer's step copies gradients, weights and state into, kept between steps.

A ``Workspace`` belongs to one optimizer (its ``step()``, and ``step_in_backward()``'s updates
under that mode's lock): one step at a time uses it, as torch.optim's own state.
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

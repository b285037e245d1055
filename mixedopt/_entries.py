"""A parameter with a gradient as ``step()`` sees it (``Entry``), grouped into packs or by device.

Entries are made by one step and live as long as it: owned by the step that made them.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._rows import ROW, rows_for


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

    @property
    def true_values(self) -> bool:
        """Whether ``grad`` holds the true gradient: no stats, or bfloat16 (storage scale 1)."""
        return self.stats is None or self.grad.dtype == torch.bfloat16


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

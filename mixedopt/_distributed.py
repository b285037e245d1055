"""Parameters whose gradients a distributed engine owns: FSDP2's DTensors and DDP's parameters.

mixedopt leaves their gradients float32, as the engine makes them, and only steps on them.
See docs/design.md, "Distributed engines".
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterable
from typing import TYPE_CHECKING, TypeGuard, cast, overload

import torch
from torch import Tensor

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def is_dtensor(t: Tensor | None) -> TypeGuard[DTensor]:
    """Whether ``t`` is a DTensor (an FSDP2 sharded parameter, for one)."""
    if type(t) in _PLAIN:  # the common case, decided without a lookup
        return False
    # Without importing torch.distributed.tensor (half a second): no DTensor exists before it.
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


_PLAIN = (Tensor, torch.nn.Parameter)


@overload
def local(t: Tensor) -> Tensor: ...
@overload
def local(t: None) -> None: ...
def local(t: Tensor | None) -> Tensor | None:
    """The rank's own part of ``t``: the local shard of a DTensor, sharing its storage.

    Called under ``torch.no_grad()`` (by ``step()``), where it is the shard itself. ``None`` (a
    state the optimizer has not created yet) stays ``None``.
    """
    return t.to_local() if is_dtensor(t) else t


def full_values(values: Iterable[Tensor]) -> list[Tensor]:
    """``values`` as plain tensors, each 0-dim DTensor replaced by its value over all ranks.

    Such a DTensor is a reduction over a sharded gradient (its norm, its largest magnitude). The
    ranks communicate once per distinct layout, not once per value.
    """
    result = list(values)
    groups: dict[tuple, list[int]] = {}
    for i, value in enumerate(result):
        if is_dtensor(value):
            groups.setdefault((value.device_mesh, tuple(value.placements)), []).append(i)
    for indices in groups.values():
        # The values of a group are DTensors: so is their stack.
        full = cast("DTensor", torch.stack([result[i] for i in indices])).full_tensor()
        for position, i in enumerate(indices):
            result[i] = full[position]
    return result


def process_group_exists() -> bool:
    """Whether this process belongs to an initialised ``torch.distributed`` process group."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def ddp_managed(params: Iterable[Tensor]) -> list[Tensor]:
    """Those of ``params`` whose gradients a live ``DistributedDataParallel`` reduces.

    Walks the objects the garbage collector tracks (one pass): call it once, not per backward.
    """
    if not process_group_exists():
        return []
    from torch.nn.parallel import DistributedDataParallel

    wanted = {id(p): p for p in params}
    found: dict[int, Tensor] = {}
    for obj in gc.get_objects():
        # type(), not isinstance(): some tracked objects warn when their __class__ is read.
        if issubclass(type(obj), DistributedDataParallel):
            for p in obj.module.parameters():
                # Parameters DDP was told to ignore keep plain gradients.
                if id(p) in wanted and not getattr(p, "_ddp_ignored", False):
                    found[id(p)] = p
    return list(found.values())

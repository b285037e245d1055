"""Which implementation updates a batch of parameters: the one place that decides.

torch.optim decides in one function (``_default_to_fused_or_foreach``) and one ``if``/``elif`` per
functional; mixedopt decides here, with one more choice, its own compiled kernels. Nothing else
reads a group's ``fused`` or ``foreach`` or the size thresholds that pick an implementation.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._budget import CPU_SMALL, budget
from ._strides import dense


class Implementation(enum.Enum):
    """An implementation of an update."""

    FOR_LOOP = "torch for-loop"
    FOREACH = "torch foreach"
    TORCH_DEFAULT = "torch's own choice"  # foreach=None: for-loop on a CPU, foreach on CUDA
    TORCH_FUSED = "torch fused"
    COMPILED = "mixedopt compiled"  # ``_compiled.py``

    def functional_kwargs(self) -> dict[str, bool | None]:
        """``foreach`` and ``fused`` for torch's functional update (not for ``COMPILED``)."""
        assert self is not Implementation.COMPILED, "the compiled kernels are not torch's"
        if self is Implementation.TORCH_FUSED:
            return {"foreach": None, "fused": True}
        foreach = {Implementation.FOR_LOOP: False, Implementation.FOREACH: True}.get(self)
        return {"foreach": foreach, "fused": False}


def fused_requested(group: dict[str, Any]) -> bool:
    """Whether the group asked for ``fused=True``."""
    return bool(group.get("fused"))


def implementation(
    group: dict[str, Any],
    params: Sequence[Tensor],
    *,
    torch_fused: bool,
    compiled: bool,
    foreach_fewer_temporaries: bool = False,
) -> Implementation:
    """The implementation that updates ``params``, a batch of ``group`` on one device.

    ``torch_fused``: the parent's functional update has a fused implementation (Adam, AdamW,
    SGD). ``compiled``: mixedopt's compiled kernels may take the batch (a ``fused=True`` group
    whose parameters have their state, and a working compiler).

    A ``fused=True`` group's batch takes torch's fused update where the parent has one, its
    parameters are dense (torch's fused kernels walk a tensor's memory from its first element
    to its size: on a strided view with gaps they would update other elements) and, when the
    compiled kernels may take it, small (up to ``budget(device).fused_small`` elements each);
    else the compiled kernels, where they may; else one of torch's other implementations.

    ``foreach=None`` (the default) takes torch's foreach implementation on a CPU for a batch of
    small tensors (``CPU_SMALL`` elements each on average, or fewer), where a dispatch per tensor
    and operation costs more than the temporaries it saves, and for any batch where
    ``foreach_fewer_temporaries`` (the parent's foreach update makes fewer temporaries than its
    for-loop: Adam's one per tensor, where its for-loop makes two; a batch is bounded, so are
    they), and leaves the choice to torch otherwise. A tensor ``lr`` leaves it to torch too:
    torch's foreach Adam refuses one without ``capturable`` (which mixedopt refuses), and
    torch's own choice avoids it.
    """
    if fused_requested(group):
        if torch_fused and dense(params) and (not compiled or _small_for_torch_fused(params)):
            return Implementation.TORCH_FUSED
        if compiled:
            return Implementation.COMPILED
    foreach = group["foreach"]
    if foreach is None and params and params[0].device.type == "cpu":
        if torch.is_tensor(group["lr"]):
            return Implementation.TORCH_DEFAULT
        elements = sum(map(Tensor.numel, params))
        if foreach_fewer_temporaries or elements <= CPU_SMALL * len(params):
            return Implementation.FOREACH
        return Implementation.FOR_LOOP
    if foreach is None:
        return Implementation.TORCH_DEFAULT
    return Implementation.FOREACH if foreach else Implementation.FOR_LOOP


def _small_for_torch_fused(params: Sequence[Tensor]) -> bool:
    if not params:
        return True
    return max(map(Tensor.numel, params)) <= budget(params[0].device).fused_small

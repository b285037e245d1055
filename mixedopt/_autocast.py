"""``mixedopt.autocast``: ``torch.autocast`` that keeps no low-precision copy of the weights.

``torch.autocast`` casts each float32 weight to float16 (or bfloat16) for the operations that
run in low precision, keeps the cast in a cache until the autocast region ends, and autograd
saves it for backward: 2 bytes per parameter held from the forward until backward has used
them. Stepping in backward frees the gradients as they come, so those copies are then what
sets the peak of a training iteration.

This context runs ``torch.autocast`` with its cache off, and saves, in place of a tensor that
is (a view of) a cast of a leaf tensor, the leaf itself and how to cast it again: backward
casts the weight a second time when it needs it. The cast is deterministic, so backward sees
the same values and computes the same gradients. It costs one more cast of each weight per
iteration (and one per use: without the cache, a weight used twice is cast twice).

A weight changed in place between the forward and backward (an optimizer step, say) would be
cast again from its new value; autograd's own check of the saved copy does not see that, so
the recast checks the weight's version itself and raises.

A ``torch.compile``d model saves the tensors of its compiled graph, which are not casts of a
leaf to this hook: same gradients, no saving.

Where a mixedopt optimizer's gradient storage manages the leaf, the hook also registers the
storage's pre-hook on the cast's node (``GradientStorage.cast_hook``): the weight's 16-bit
gradient goes to the storage as it is, and autograd makes no float32 copy of it. A cast no
operation saves (a first layer's, over data that needs no gradient) is found by a short search
back from a later saved tensor (``_Region``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ._storage import cast_hook

# The dtypes autocast casts to, and the method that casts to each: it does what ``to(dtype)``
# does, with less argument parsing (a recast of a small weight is mostly dispatch).
_CASTS = {torch.float16: Tensor.half, torch.bfloat16: Tensor.bfloat16, torch.float32: Tensor.float}


class _Recast:
    """A saved cast of a leaf tensor, to be made again in backward."""

    __slots__ = ("leaf", "version", "cast", "size", "stride", "offset")

    def __init__(self, leaf: Tensor, saved: Tensor) -> None:
        self.leaf = leaf
        self.version = leaf._version
        self.cast = _CASTS[saved.dtype]
        self.size, self.stride, self.offset = saved.size(), saved.stride(), saved.storage_offset()

    def tensor(self) -> Tensor:
        if self.leaf._version != self.version:
            raise RuntimeError(
                "mixedopt.autocast: a weight was changed in place between the forward and the "
                "backward that needs it (an optimizer step, say), so its low-precision cast "
                "cannot be made again; step after backward, or use torch.autocast"
            )
        cast = self.cast(self.leaf.detach())
        return cast.as_strided(self.size, self.stride, self.offset)


class _Region:
    """The saved-tensor hooks of one region, owned by the thread that runs its forward.

    Besides saving casts as ``_Recast``, it hands each weight cast it finds to the gradient
    storage (``cast_hook``). A saved cast is found as it is saved. An operation whose other
    operand needs no gradient (a model's first layer, over its data) saves that operand and
    not the cast; saving a tensor that needs no gradient arms a search for such casts, which the
    next saved tensor that has a node runs back through the nodes made since the tensors saved
    before (autograd numbers a thread's nodes in the order it makes them, a node after those it
    reads from). A cast only an unsaved tensor depends on is not found: its gradient is stored
    from float32, as under ``torch.autocast``.
    """

    __slots__ = ("newest", "floor")

    def __init__(self) -> None:
        self.newest = -1  # the number of the newest node a saved tensor had
        self.floor: int | None = None  # while armed: nodes up to this number were searched

    def pack(self, saved: Tensor) -> Any:
        base = saved._base if saved._base is not None else saved
        node = base.grad_fn
        if node is None:
            if self.floor is None and not saved.requires_grad and saved.is_floating_point():
                self.floor = self.newest
            return saved
        number = node._sequence_nr()
        if number > self.newest:
            self.newest = number
        leaf = _cast_leaf(node) if type(node).__name__ == "ToCopyBackward0" else None
        if leaf is None:
            if self.floor is not None:
                self._search(node, self.floor)
                self.floor = None
            return saved
        if leaf.dtype != saved.dtype and saved.dtype in _CASTS and leaf.is_floating_point():
            _hand_over(node, leaf, base.dtype)
            return _Recast(leaf, saved)
        return saved

    @staticmethod
    def _search(start: Any, floor: int) -> int:
        """Hand over the casts of leaves among ``start`` and the nodes it reads from.

        Only nodes made after node number ``floor`` are searched. Returns how many were.
        """
        seen = set()
        stack = [start]
        while stack:
            node = stack.pop()
            if node is None or node in seen or node._sequence_nr() <= floor:
                continue
            seen.add(node)
            if type(node).__name__ == "ToCopyBackward0":
                leaf = _cast_leaf(node)
                if leaf is not None:
                    _hand_over(node, leaf, node._input_metadata[0].dtype)
                    continue
            stack.extend(next_node for next_node, _ in node.next_functions)
        return len(seen)


def _cast_leaf(node: Any) -> Tensor | None:
    """The leaf tensor a cast's ``node`` reads (``None``: it casts no leaf)."""
    return getattr(node.next_functions[0][0], "variable", None)  # an AccumulateGrad's tensor


def _hand_over(node: Any, leaf: Tensor, dtype: torch.dtype) -> None:
    """Register the storage's pre-hook on a cast's ``node`` (``leaf`` to ``dtype``).

    Where a storage manages ``leaf`` and takes its gradients in ``dtype`` (``cast_hook``).
    """
    hook = cast_hook(leaf, dtype)
    if hook is not None:
        node.register_prehook(hook)  # a second one on the same cast is handed nothing


def _unpack(packed: Any) -> Tensor:
    return packed.tensor() if isinstance(packed, _Recast) else packed


@contextlib.contextmanager
def autocast(
    device_type: str, dtype: torch.dtype | None = None, enabled: bool = True
) -> Iterator[None]:
    """``torch.autocast(device_type, dtype, enabled)`` that saves no cast weight for backward.

    Use it for the forward, as ``torch.autocast``. Gradients are the same as under
    ``torch.autocast``. Backward casts each weight again when it needs it; a weight changed in
    place since the forward raises a ``RuntimeError``. A large weight of a mixedopt optimizer
    gets the 16-bit gradient of its low-precision operation as its ``.grad``, with no float32
    copy in between (docs/step-in-backward.md).

    Args:
        device_type: ``"cuda"``, ``"cpu"`` or another device type, as for ``torch.autocast``.
        dtype: the low-precision dtype, ``torch.float16`` or ``torch.bfloat16``; ``None``
            (default): ``torch.autocast``'s default for the device type.
        enabled: ``False`` runs the region without autocast (default ``True``).

    Yields:
        Nothing; the forward runs inside the ``with`` block.

    Example:
        ```python
        import torch
        import mixedopt

        model = torch.nn.Linear(8, 2)
        optimizer = mixedopt.AdamW(model.parameters(), lr=1e-3)
        with mixedopt.autocast("cpu", dtype=torch.bfloat16):  # in place of torch.autocast
            loss = model(torch.randn(4, 8)).float().square().mean()
        with optimizer.step_in_backward():
            loss.backward()
        ```
    """
    with (
        torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False),
        torch.autograd.graph.saved_tensors_hooks(_Region().pack, _unpack),
    ):
        yield

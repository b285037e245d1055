"""Whether a gradient autograd hands a hook is held by nothing else: it may be kept or changed.

torch's ``AccumulateGrad`` makes an incoming gradient ``.grad`` without copying it when nothing
else holds it, judged by its C++ reference count. A Python pre-hook sees that count too
(``Tensor._use_count()``, and its storage's and its base's), plus the Python references to the
tensor object, which C++ counts as one: a gradient a hook elsewhere kept, or another node's
pre-hook, shows only there (``sys.getrefcount``). How many references the hook's own call adds
depends on torch's and Python's internals, so they are measured once, at import, on a small
backward (``_measure``), at the pre-hooks of both nodes mixedopt hooks (a weight's cast and its
``AccumulateGrad``), not assumed: where a gradient held elsewhere cannot be told from one held
by nothing else, ``sole_holder`` is always ``False`` and every gradient is copied.

Taking or overwriting a gradient held elsewhere would be a silent error: a later in-place
change of ``.grad`` (``clip_grad_norm_``, ``zero_grad(set_to_none=False)``), or the store's
scaling, would change the other holder's tensor.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

Counts = tuple[int, int, int, int]
# Counts that no gradient held by nothing else shows.
UNKNOWN: Counts = (-1, -1, -1, -1)


def _counts(grad_outputs: tuple[Tensor | None, ...]) -> Counts:
    """The references to a pre-hook's gradient, its storage, its base (0: none) and its object.

    Called with the hook's own argument, before the hook holds the gradient in a variable.
    ``UNKNOWN`` for no gradient (``None``) or a tensor without a storage of its own to count
    (sparse, or a subclass's).
    """
    grad = grad_outputs[0]
    if grad is None:
        return UNKNOWN
    try:
        storage = torch._C._storage_Use_Count(grad.untyped_storage()._cdata)
    except (NotImplementedError, RuntimeError):
        return UNKNOWN
    base = grad._base
    use_count = Tensor._use_count  # type: ignore[attr-defined]  # not in torch's stubs
    return (
        use_count(grad),
        storage,
        0 if base is None else use_count(base),
        sys.getrefcount(grad),
    )


def _measure() -> frozenset[Counts]:
    """The counts a pre-hook sees for a gradient nothing else holds (empty: unknown).

    Two forms: a tensor of its own, and a view of one (a weight used transposed gets the
    transpose of its product's gradient), each at a cast's pre-hook and at a leaf's
    ``AccumulateGrad`` pre-hook. Empty where a gradient held elsewhere shows the counts of one
    held by nothing else, where the two nodes' hooks see different counts, or where a count
    cannot be read.
    """
    seen: dict[str, list[Counts]] = {"alone": [], "shared": [], "kept": []}

    def seeing(name: str):  # noqa: ANN202 - autograd hook
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> None:
            seen[name].append(_counts(grad_outputs))

        return hook

    weight = torch.ones(2, 2, requires_grad=True)
    nodes: list[object] = []  # the leaves' hooked nodes, alive until the measure ends

    def cast(name: str) -> Tensor:
        """A cast of ``weight``, its node hooked."""
        made = weight.half()
        assert made.grad_fn is not None
        made.grad_fn.register_prehook(seeing(name))
        return made

    def leaf(name: str) -> Tensor:
        """A leaf of its own, its ``AccumulateGrad`` hooked (and held: else it is dropped)."""
        made = torch.ones(2, 2, requires_grad=True)
        view = made.view_as(made).grad_fn
        assert view is not None
        node = view.next_functions[0][0]
        assert node is not None
        node.register_prehook(seeing(name))
        nodes.append(node)
        return made

    try:
        with torch.enable_grad(), torch.autocast("cpu", enabled=False):
            kept: list[Tensor] = []
            # At a cast's node, where float16 gradients arrive, then at a leaf's own node,
            # where float32 ones do.
            for hooked, dtype in ((cast, torch.float16), (leaf, torch.float32)):
                right = torch.ones(2, 2, dtype=dtype)
                # Held by nothing else: a matrix product's gradient reaches the node alone, as
                # a tensor of its own and as a transposed view of one.
                own, transposed = hooked("alone"), hooked("alone")
                (own @ right + right @ transposed.t()).float().sum().backward()
                # Held by another node: an addition hands one tensor to both of its inputs;
                # the first of the two nodes to run sees it held by the other's input too.
                ((hooked("shared") + hooked("shared")) @ right).float().sum().backward()
                # Held by a hook that kept it: a tensor hook runs before the node's pre-hooks.
                stashed = hooked("kept")
                stashed.register_hook(kept.append)
                (stashed @ right).float().sum().backward()
    except (AttributeError, RuntimeError):  # a count this torch does not give
        return frozenset()
    alone, shared, kept_counts = seen["alone"], seen["shared"], seen["kept"]
    if (len(alone), len(shared), len(kept_counts)) != (4, 4, 2):
        return frozenset()
    if set(alone[:2]) != set(alone[2:]):  # the two nodes' hooks see a gradient alike
        return frozenset()
    held_elsewhere = (shared[0], shared[2], *kept_counts)  # each pair's first to run
    if any(counts in alone for counts in held_elsewhere):
        return frozenset()
    return frozenset(alone)


# Measured at import, in no dispatch mode, autocast region or backward of the caller's.
_ALONE = _measure()


def sole_holder(grad_outputs: tuple[Tensor | None, ...]) -> bool:
    """Whether ``grad_outputs[0]``, handed to a node pre-hook by autograd, is held by nothing else.

    Call it with the hook's argument before the hook holds the gradient in a variable (a
    reference more). ``True``: only autograd's call holds it and no other tensor shares its
    memory: it may become a parameter's ``.grad`` as it is, as ``AccumulateGrad`` would make it,
    or be overwritten.
    """
    return _counts(grad_outputs) in _ALONE

"""What the gradient storage keeps per parameter, per backward and per backward and device.

A slot holds a parameter's hook, the stats row of the gradient the storage wrote into its
``.grad``, and the bucket its gradients wait in. A bucket holds the small gradients of one
backward on one device that wait to be stored together (``_bucket_store.py``); the backward's
``Backward`` stores its buckets when it ends. See docs/design.md, "Who owns what".
"""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from ._budget import budget
from ._eager import run_eagerly
from ._strides import dense_strides

# Takes parameters whose gradients were just stored (``GradientStorage.set_consumer``).
Consumer = Callable[[list[Tensor]], None]

# Read in C by ``map`` over many slots (a Python loop per parameter costs more than the reads).
_grad_of_slot = operator.attrgetter("param.grad")
_is_sparse = operator.attrgetter("is_sparse")


class Slot:
    """What the storage knows about one parameter and its ``.grad``."""

    __slots__ = (
        "param",
        "accumulator",
        "handles",
        "original_grad_dtype",
        "holders",
        "stats",
        "row",
        "grad_ref",
        "grad_version",
        "engine_owned",
        "installed",
        "pending",
        "layout",
        "shape",
        "strides",
        "consumer",
        "cast_hook",
        "staged",
        "bucket",
        "elements",
        "__weakref__",
    )

    def __init__(self, param: Tensor) -> None:
        self.param = param
        # Holding the AccumulateGrad node keeps it (and the hook on it) alive between backwards.
        # A view records its grad_fn only with grad mode on and outside inference mode (an
        # optimizer made under no_grad() or inference_mode()).
        with torch.inference_mode(False), torch.enable_grad():
            grad_fn = param.view_as(param).grad_fn
        assert grad_fn is not None, "not an inference tensor (refused by the optimizer)"
        self.accumulator: Any = grad_fn.next_functions[0][0]
        self.handles: list[Any] = []
        self.original_grad_dtype = param.grad_dtype
        self.holders = 0  # optimizers holding the parameter: the slot goes with the last one
        # Row ``row`` of ``stats`` is [storage scale, bound on |true gradient|] of the .grad this
        # storage wrote (p.grad == true gradient * scale); ``stats`` has a row per gradient
        # stored with it. None: the .grad it wrote holds true values, never measured (a 16-bit
        # gradient stored as it is, ``StorageScales.store_alone``).
        self.stats: Tensor | None = None
        self.row = 0
        self.grad_ref: weakref.ref[Tensor] | None = None  # the .grad tensor this storage wrote
        self.grad_version = -1  # its version counter when written
        self.engine_owned = False  # a distributed engine reads the gradient: left float32
        self.installed = True  # False once let go (a hook under way then leaves it to autograd)
        self.pending = False  # its gradient waits in a bucket
        # The parameter's strides when its stored gradient's shape and strides were found.
        self.layout: tuple[int, ...] = ()
        self.shape = param.shape
        self.strides: tuple[int, ...] = ()
        # Called with the parameter as soon as its gradient is stored, in backward (an
        # optimizer's step_in_backward); None: the gradient stays in p.grad.
        self.consumer: Consumer | None = None
        # The pre-hook that takes the 16-bit gradient a cast of the parameter receives
        # (``GradientStorage.cast_hook``).
        self.cast_hook: Callable[..., object] | None = None
        # The 16-bit gradients its casts handed over in the running backward, to be stored by
        # its own hook (``GradientStorage._stage``); owned by the backward claiming the slot.
        # Each with whether nothing else held it (``_takeover.sole_holder``).
        self.staged: list[tuple[Tensor, bool]] = []
        # The bucket its gradients wait in, for the hook's common case (set by ``_take``), and
        # the elements they take there (whole rows).
        self.bucket: Bucket | None = None
        self.elements = 0

    def owns(self, grad: Tensor | None) -> bool:
        return grad is not None and self.grad_ref is not None and self.grad_ref() is grad

    def grad_strides(self) -> tuple[int, ...]:
        """The strides of the stored gradient: the parameter's own layout when it is dense."""
        layout = self.param.stride()
        if layout != self.layout:  # first use, or new memory (``p.data = ...``, channels_last)
            self.layout, self.shape = layout, self.param.shape
            self.strides = dense_strides(self.param)
        return self.strides

    def record(self, grad: Tensor, stats: Tensor | None, row: int, version: int) -> None:
        self.param.grad = grad
        self.grad_ref = weakref.ref(grad)
        self.grad_version = version
        self.stats, self.row = stats, row
        self.pending = False


class Bucket:
    """Gradients of one backward on one device waiting to be stored together, in arrival order.

    A waiting gradient is in its ``p.grad``, float32 and true, as torch.optim would have it:
    autograd put it there (the hook's common case) or the hook did (``_take``). ``previous``
    keeps what ``p.grad`` held before, where it held something: they are added when stored.

    A bucket is *armed* for one backward (``task``, its graph task id) from that backward's
    first gradient on the device to its end: only that backward's hooks fill it, and they run on
    one thread (the one autograd runs the device's part of that backward on). Its slots keep
    pointing to it, so that the next backward of the same model arms the same bucket again and
    finds it in their hook (the common case) without a lookup.
    """

    __slots__ = (
        "device",
        "limits",
        "capacity",
        "small",
        "task",
        "owner",
        "slots",
        "previous",
        "elements",
    )

    def __init__(self, device: torch.device) -> None:
        limits = self.limits = budget(device)
        self.device = device
        self.capacity = limits.capacity  # elements, in whole rows
        self.small = limits.bucket_small  # the largest gradient that waits in a bucket
        self.task: int | None = None  # the backward it is armed for (None: free)
        # That backward, weakly: dead once the backward is over (``Backward``).
        self.owner: weakref.ref[Backward] | None = None
        self.slots: list[Slot] = []
        self.previous: dict[int, Tensor] = {}  # position in ``slots`` -> earlier p.grad
        self.elements = 0

    def running(self) -> bool:
        """Whether the backward it is armed for is still running (it may add gradients)."""
        owner = self.owner
        return owner is not None and owner() is not None

    def clear(self) -> None:
        self.slots, self.previous, self.elements = [], {}, 0

    def take_waiting(self) -> tuple[list[Slot], list[Tensor], dict[int, Tensor]]:
        """Empty the bucket: its slots, their gradients and what they are added to.

        Leaves out a gradient gone from ``p.grad`` (``zero_grad()`` after a backward that
        raised, say: what it cleared is not stored) and a sparse one (autograd keeps it). The
        slots it returns stay ``pending`` until their gradients are stored (``_store_bucket``
        clears it in its loop over them); those it leaves out no longer wait.
        """
        slots, previous = self.slots, self.previous
        self.clear()
        grads = list(map(_grad_of_slot, slots))
        # The common case, all there and dense, is checked without a Python step per gradient.
        if all(map(operator.is_not, grads, itertools.repeat(None))) and not any(
            map(_is_sparse, grads)
        ):
            return slots, grads, previous
        for slot in slots:
            slot.pending = False
        kept = [i for i, grad in enumerate(grads) if grad is not None and not grad.is_sparse]
        return (
            [slots[i] for i in kept],
            [grads[i] for i in kept],
            {n: previous[i] for n, i in enumerate(kept) if i in previous},
        )


class Backward:
    """One backward (an autograd graph task) as the storage sees it: its end stores its buckets.

    Queued on the autograd engine as the backward's end-of-backward callback, so the engine
    holds it while the backward runs, and drops it when the backward ends (after calling it) or
    raises (without calling it). The storage and the backward's buckets hold it weakly: a dead
    ``Backward`` is a backward that will add nothing more, whose buckets anyone may store.
    """

    __slots__ = ("task", "finish", "__weakref__")

    def __init__(self, task: int, finish: Callable[[int], None]) -> None:
        self.task = task
        self.finish = finish

    @run_eagerly  # called from the frame that ran backward(), which may be compiled
    def __call__(self) -> None:
        self.finish(self.task)

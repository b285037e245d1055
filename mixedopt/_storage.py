"""Gradient storage: makes each ``.grad`` of a float32 parameter land in a 16-bit dtype.

A pre-hook on each parameter's ``AccumulateGrad`` node takes the float32 gradient; small ones
wait in a bucket stored at the end of backward (``_bucket_store.py``), large ones are stored at
once (``_scales.py``). In float16 ``p.grad`` holds the true gradient times a power-of-two storage
scale. This module keeps a slot per parameter, installs and removes the hooks, takes what
arrives (``_take``) and lets go of an optimizer's parameters. See docs/design.md, "The gradient
storage".
"""

from __future__ import annotations

import collections
import threading
import warnings
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from . import _packing
from ._bucket_store import BucketStore, GroupIndex, WholeBucket
from ._distributed import ddp_managed, process_group_exists
from ._eager import run_eagerly
from ._packing import ROW, StoredRows, rows_for
from ._scales import StorageScales
from ._slots import Bucket, Consumer, Slot
from ._storage_work import deferring_releases

SUPPORTED_GRAD_DTYPES = (torch.float16, torch.bfloat16)

# False when called; dynamo traces it as True (compiled autograd traces the storage's hooks).
_traced_by_dynamo = torch.compiler.is_dynamo_compiling

# Parameters managed by a live GradientStorage: one storage per parameter.
_managed: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The storage of each grad_dtype, shared by every optimizer of the process (``shared``).
_shared: dict[torch.dtype, GradientStorage] = {}


class GradientStorage:
    """Keeps the ``.grad`` of the parameters it manages in ``grad_dtype`` with a storage scale.

    The gradient storage belongs to the parameters, not to an optimizer: one storage per
    ``grad_dtype`` serves the process (``shared``), and every mixedopt optimizer holding a
    parameter holds it through a *holder*, the set of parameter ids it installed.
    ``release(holder)`` lets go of them; a parameter no optimizer holds any more loses its hook
    and gets its true float32 gradient back. The storage references no optimizer.

    It keeps a slot per parameter and the buckets waiting to be stored; its components store
    them (``_bucket_store.BucketStore``) and find and undo the storage scales
    (``_scales.StorageScales``).
    """

    @staticmethod
    def shared(grad_dtype: torch.dtype) -> GradientStorage:
        """The storage of ``grad_dtype`` (a parameter's gradients have one dtype at a time)."""
        storage = _shared.get(grad_dtype)
        if storage is None:
            storage = _shared[grad_dtype] = GradientStorage(grad_dtype)
        return storage

    def __init__(self, grad_dtype: torch.dtype) -> None:
        self.grad_dtype = grad_dtype
        self._slots: dict[int, Slot] = {}
        self._unchecked: list[Slot] = []  # not looked up yet for a distributed engine
        self._engines_looked_up_in = -2  # the backward (graph task) that last looked them up
        self._buckets: dict[torch.device, Bucket] = {}  # the bucket filling, per device
        self._scales = StorageScales(grad_dtype)
        self._bucket_store = BucketStore(grad_dtype, self._scales)
        self._consumed = 0  # slots with a consumer
        self.working = 0  # storage methods running (``deferring_releases``)
        # Releases that came where they could not run: during storage work, from a finalizer
        # (``release_when_safe``). Appended by any thread.
        self.waiting_releases: collections.deque[set[int]] = collections.deque()

    def __contains__(self, param: Tensor) -> bool:
        return id(param) in self._slots

    def holders(self, param: Tensor) -> int:
        """How many optimizers hold ``param`` (0: its gradient is not stored here)."""
        slot = self._slots.get(id(param))
        return 0 if slot is None else slot.holders

    def left_to_engine(self, param: Tensor) -> bool:
        """Whether a distributed engine (DDP) was found to reduce ``param``'s gradient."""
        slot = self._slots.get(id(param))
        return slot is not None and slot.engine_owned

    def check_can_manage(self, param: Tensor) -> None:
        owner = _managed.get(param)
        if owner is not None and owner is not self:
            raise ValueError(
                f"a parameter's gradient is already stored in {owner.grad_dtype} for another "
                f"mixedopt optimizer, and a gradient has one dtype: create this one with "
                f"grad_dtype={owner.grad_dtype} (or call remove_grad_storage() on the "
                "optimizers holding the parameter first)"
            )

    def install(self, param: Tensor, holder: set[int]) -> None:
        """Make ``param.grad`` land in ``grad_dtype``, held by ``holder``.

        Frozen parameters are left alone. A parameter another optimizer holds already keeps its
        storage, now held by both.
        """
        if self.waiting_releases:  # the parameters of optimizers collected since
            self.release_waiting()
        if id(param) in holder or not param.requires_grad:
            return
        self.check_can_manage(param)
        slot = self._slots.get(id(param))
        if slot is None:
            slot = Slot(param)
            param.grad_dtype = None  # accept a .grad whose dtype differs from the parameter's
            slot.handles.append(slot.accumulator.register_prehook(self._accumulate_hook(slot)))
            self._slots[id(param)] = slot
            self._unchecked.append(slot)
            _managed[param] = self
        slot.holders += 1
        holder.add(id(param))

    def _leave_to_engines(self) -> None:
        """Leave float32 the gradients of the parameters a DistributedDataParallel reduces.

        Its reducer reads each gradient right after autograd stores it and accepts only the
        parameter's dtype. Looked up once per parameter, at the first backward with a process
        group.
        """
        if not process_group_exists():
            return
        unchecked, self._unchecked = self._unchecked, []
        taken = ddp_managed(slot.param for slot in unchecked if id(slot.param) in self._slots)
        for param in taken:
            slot = self._slots[id(param)]
            slot.engine_owned = True
            slot.bucket = None  # its hook takes ``_take``, which leaves it to autograd
            param.grad_dtype = slot.original_grad_dtype
        if taken:
            warnings.warn(
                f"mixedopt: {len(taken)} parameter(s) are reduced by "
                "torch.nn.parallel.DistributedDataParallel, which needs float32 gradients and "
                "keeps its own float32 copy of them; their gradients stay float32 (no memory "
                "saved). Call remove_grad_storage() after creating the optimizer to say so and "
                "silence this warning.",
                UserWarning,
                stacklevel=2,
            )

    # ------------------------------------------------------------------ during backward

    def _accumulate_hook(self, slot: Slot):  # noqa: ANN202 - autograd hook
        param = slot.param

        @run_eagerly  # called from a compiled frame (backward() inside torch.compile)
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None] | None:
            if _traced_by_dynamo():
                # Compiled autograd traces the backward into one graph: autograd stores the
                # float32 gradient, and step() takes it as the true gradient.
                return None
            # Runs for every parameter in every backward, between backward's own operations,
            # which leave the caches cold for it: each tensor attribute it reads is costly there.
            # The common case reads one. A non-empty bucket (``slot.bucket``,
            # set by ``_take``) is stored at the end of the backward under way, so the hook only
            # marks the parameter as waiting and lets autograd put the float32 gradient in
            # ``p.grad``, as it does for torch.optim; the bucket's store takes it from there.
            # Every other case goes to ``_take``. Autograd runs the hooks of one device on one
            # thread, and they share nothing with another device's but ``_take``'s bookkeeping.
            bucket = slot.bucket
            if (
                bucket is not None
                and bucket.elements
                and not slot.pending
                and bucket.elements + slot.elements <= bucket.capacity
                and param.grad is None
            ):
                bucket.slots.append(slot)
                bucket.elements += slot.elements
                slot.pending = True
                return None  # autograd stores it, as it would without mixedopt
            return self._take(slot, grad_outputs[0])

        return hook

    @deferring_releases  # a finalizer may run in the middle of it
    def _take(self, slot: Slot, incoming: Tensor | None) -> tuple[None] | None:
        """The hook's other cases, out of its way.

        The first gradient of a backward (or of a device), one that would overflow its bucket,
        one left waiting by a backward that ended early, one added to an earlier gradient, a
        gradient too large for a bucket, and those autograd keeps: a distributed engine's,
        sparse ones (``step()`` refuses them).
        """
        param = slot.param
        previous = param.grad
        if self._unchecked:  # looked for once per backward (a process group comes before it)
            task = torch._C._current_graph_task_id()
            if task != self._engines_looked_up_in:
                self._engines_looked_up_in = task
                self._leave_to_engines()
        if (
            slot.engine_owned
            or incoming is None
            or incoming.is_sparse
            or (previous is not None and previous.is_sparse)
        ):
            return None  # autograd stores it
        device = incoming.device
        bucket = self._buckets.get(device)
        if bucket is None or bucket.limits is not _packing.budget(device):
            if bucket is not None:  # the budget was changed (tests do): a bucket for it
                self._store_bucket(bucket)
            bucket = self._buckets[device] = Bucket(device)
        if slot.pending:  # waits from a backward that raised: stored first
            self._store_bucket(bucket)
            previous = param.grad
        numel = incoming.numel()
        if numel > bucket.small:
            slot.bucket = None
            self._store_alone(slot, incoming, previous)
            return (None,)
        task = torch._C._current_graph_task_id()
        if bucket.task != task:  # what waits is stored when this backward ends
            bucket.task = task
            torch.autograd.Variable._execution_engine.queue_callback(self.flush)
        slot.elements = rows_for(numel) * ROW  # whole rows
        slot.bucket = bucket  # the hook's common case, from now on
        if bucket.elements + slot.elements > bucket.capacity:
            self._store_bucket(bucket)
        if previous is not None:
            bucket.previous[len(bucket.slots)] = previous
        bucket.slots.append(slot)
        bucket.elements += slot.elements
        slot.pending = True
        if previous is None:
            return None  # autograd stores it in p.grad, as in the hook's common case
        param.grad = incoming  # true values until stored, as torch.optim would have them
        return (None,)  # taken: autograd stores nothing

    @deferring_releases  # a finalizer may run in the middle of it
    @torch.no_grad()
    def _store_bucket(self, bucket: Bucket) -> None:
        """Store what waits in ``bucket``, and hand it to the consumers (``set_consumer``)."""
        if not bucket.slots:
            return
        slots = self._bucket_store.store(bucket)
        if slots and self._consumed:
            self._hand_over(slots)

    @deferring_releases
    @torch.no_grad()
    def _store_alone(self, slot: Slot, incoming: Tensor, previous: Tensor | None) -> None:
        """Store one gradient (added to ``previous``) on its own, and hand it to its consumer."""
        self._scales.store_alone(slot, incoming, previous, self._bucket_store.scratch)
        if slot.consumer is not None:
            slot.consumer([slot.param])

    @deferring_releases
    def flush(self) -> None:
        """Store every gradient still waiting in a bucket."""
        for bucket in list(self._buckets.values()):
            bucket.task = None
            self._store_bucket(bucket)

    def set_consumer(self, params: Iterable[Tensor], consumer: Consumer | None) -> None:
        """Hand the gradients of ``params`` to ``consumer`` as soon as they are stored.

        Backward stores a bucket (or a large gradient) and calls ``consumer`` with its
        parameters at once, their ``.grad`` set; ``None`` ends it. A consumer runs inside
        backward, under ``torch.no_grad()``.
        """
        for param in params:
            slot = self._slots.get(id(param))
            if slot is None:
                continue
            self._consumed += (consumer is not None) - (slot.consumer is not None)
            slot.consumer = consumer

    @deferring_releases
    def run_as_storage_work(self, work: Callable[[], None]) -> None:
        """Run ``work``, a consumer's use of stored gradients, as storage work.

        For a consumer's work outside the stores that call it (at the end of a backward): an
        optimizer's release that comes in its middle waits until it ends, as in a store.
        """
        work()

    @staticmethod
    def _hand_over(slots: list[Slot]) -> None:
        """Call each consumer with its parameters among ``slots``, in order."""
        taken: dict[Consumer, list[Tensor]] = {}
        for slot in slots:
            if slot.consumer is not None:
                taken.setdefault(slot.consumer, []).append(slot.param)
        for consumer, params in taken.items():
            consumer(params)

    # ------------------------------------------------------------------ letting go

    def release(self, holder: set[int]) -> None:
        """Let go of the parameters ``holder`` holds.

        Those no optimizer holds any more lose their hook and get their true float32 gradient
        back (what waits in a bucket is stored first). Called in the middle of storage work, it
        runs when that work ends.
        """
        if self.working:
            self.waiting_releases.append(holder)
            return
        self._release_now(holder)

    @run_eagerly  # the garbage collector may run it inside a compiled frame
    def release_when_safe(self, holder: set[int]) -> None:
        """``release``, for a finalizer: the garbage collector runs it wherever it happens to run.

        Inside a trace (torch.compile's, or any dispatch mode's) the tensors it would make are
        the trace's; on a thread other than the main one it could run while a backward stores
        gradients on another. There, and during storage work, it waits: for the end of the
        next storage work (the next backward that stores a gradient, the next ``step()``) or
        the next optimizer's construction, whichever comes first.
        """
        if (
            self.working
            or self._backward_under_way()
            or torch._C._len_torch_dispatch_stack()
            or threading.current_thread() is not threading.main_thread()
        ):
            self.waiting_releases.append(holder)
            return
        self._release_now(holder)

    def release_waiting(self) -> None:
        """Run the releases that waited, unless inside a trace or a backward (they wait on)."""
        if self.working or self._backward_under_way() or torch._C._len_torch_dispatch_stack():
            return
        while self.waiting_releases:
            self._release_now(self.waiting_releases.popleft())

    def _backward_under_way(self) -> bool:
        """Whether a backward has gradients waiting for its end in a bucket.

        A release there would store them early, in other buckets than the backward alone makes.
        """
        return any(bucket.task is not None for bucket in self._buckets.values())

    def _release_now(self, holder: set[int]) -> None:
        self.flush()
        for key in holder:
            slot = self._slots.get(key)
            if slot is None:
                continue
            slot.holders -= 1
            if slot.holders == 0:
                self._uninstall(slot)
        holder.clear()
        if not self._slots:  # nothing left to store: give the buffers back
            self._bucket_store.clear()
            self._buckets.clear()

    def _uninstall(self, slot: Slot) -> None:
        self._consumed -= slot.consumer is not None
        for handle in slot.handles:
            handle.remove()
        param = slot.param
        if param.grad is not None and not param.grad.is_sparse and not slot.engine_owned:
            true = self.true_grad(param)
            assert true is not None, "release() stored what waited: param.grad is still set"
            param.grad = true.to(param.dtype)
        param.grad_dtype = slot.original_grad_dtype
        del self._slots[id(param)]
        if _managed.get(param) is self:
            del _managed[param]

    # ------------------------------------------------------------------ for step()

    def stats_of(self, param: Tensor) -> tuple[Tensor | None, int, bool]:
        """Where ``param.grad``'s storage scale and bound are, and whether the bound holds.

        ``(stats, row, current)``: row ``row`` of ``stats`` is ``[storage scale, bound on |true
        gradient|]`` (``stats_table`` gathers such rows). ``stats`` is ``None`` where
        ``param.grad`` holds true values (assigned by hand, or not stored by this storage). The
        bound was measured when the gradient was stored (inf or NaN there makes it inf or NaN);
        it no longer holds once ``p.grad`` was changed in place.
        """
        slot = self._slots.get(id(param))
        grad = param.grad
        if slot is None or not slot.owns(grad):
            return None, 0, False
        assert grad is not None
        return slot.stats, slot.row, grad._version == slot.grad_version

    def stats_table(
        self, found: list[tuple[Tensor | None, int]], device: torch.device
    ) -> tuple[Tensor, list[int]]:
        """Rows ``[storage scale, |true gradient| bound]``, one per ``(stats, row)`` of ``found``.

        ``found`` holds what ``stats_of`` gives; see ``_scales.StorageScales.stats_table``.
        """
        return self._scales.stats_table(found, device)

    def scale_of(self, param: Tensor) -> Tensor | None:
        """The storage scale of ``param.grad`` (``None`` where it holds true values)."""
        stats, row, _ = self.stats_of(param)
        return None if stats is None else stats[row, 0]

    def true_grad(self, param: Tensor) -> Tensor | None:
        """The true gradient of ``param`` as a new float32 tensor (``None`` where it has none)."""
        self.flush()
        grad = param.grad
        if grad is None:
            return None
        scale = self.scale_of(param)
        true = grad.to(torch.float32, copy=True)
        return true if scale is None else true.div_(scale)

    def stored_bucket(self, stats: Tensor) -> StoredRows | None:
        """The 16-bit rows of the bucket whose stats table is ``stats``, or ``None``.

        See ``_bucket_store.BucketStore.stored_bucket``.
        """
        return self._bucket_store.stored_bucket(stats)

    def whole_buckets(self, groups: GroupIndex) -> tuple[list[WholeBucket], int]:
        """The stored buckets all of whose gradients ``groups`` hold, and how many they leave.

        See ``_bucket_store.BucketStore.whole_buckets``.
        """
        return self._bucket_store.whole_buckets(groups)

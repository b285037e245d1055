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
import contextlib
import itertools
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable

import torch
from torch import Tensor
from torch.utils.weak import WeakIdKeyDictionary

from ._bucket_store import BucketStore, GroupIndex, WholeBucket
from ._budget import Budget, budget
from ._distributed import ddp_managed, process_group_exists
from ._eager import run_eagerly
from ._rows import ROW, StoredRows, rows_for
from ._scales import StorageScales
from ._slots import Backward, Bucket, Consumer, Slot
from ._storage_work import StorageWork, deferring_releases
from ._takeover import sole_holder

SUPPORTED_GRAD_DTYPES = (torch.float16, torch.bfloat16)

# False when called; dynamo traces it as True (compiled autograd traces the storage's hooks).
_traced_by_dynamo = torch.compiler.is_dynamo_compiling
# The id of the backward (autograd graph task) running on this thread; -1 outside one.
_current_backward = torch._C._current_graph_task_id
# Who holds a slot's gradient (``GradientStorage._claims``): a backward's graph task id (0 and
# up), or a release in progress.
_RELEASING = -2

# Parameters managed by a live GradientStorage: one storage per parameter.
_managed: WeakIdKeyDictionary = WeakIdKeyDictionary()
# The storage of each grad_dtype, shared by every optimizer of the process (``shared``).
_shared: dict[torch.dtype, GradientStorage] = {}


def _accumulates(slot: Slot) -> bool:
    """Whether the running backward accumulates ``slot``'s gradient into ``.grad``.

    Not under ``torch.autograd.grad``, which returns the gradient (torch refuses to answer there
    for an ``AccumulateGrad`` node, and raises), nor under ``backward(inputs=...)`` without
    the parameter.
    """
    try:
        return torch._C._will_engine_execute_node(slot.accumulator)
    except RuntimeError:
        return False


class GradientStorage:
    """Keeps the ``.grad`` of the parameters it manages in ``grad_dtype`` with a storage scale.

    The gradient storage belongs to the parameters, not to an optimizer: one storage per
    ``grad_dtype`` serves the process (``shared``), and every mixedopt optimizer holding a
    parameter holds it through a *holder*, the set of parameter ids it installed.
    ``release(holder)`` lets go of them; a parameter no optimizer holds any more loses its hook
    and gets its true float32 gradient back. The storage references no optimizer.

    It keeps a slot per parameter and the buckets the running backwards fill; its components
    store them (``_bucket_store.BucketStore``) and find and undo the storage scales
    (``_scales.StorageScales``).

    Several threads use it at once (each device's part of a backward runs on that device's
    thread; several backwards may run at once). Who owns what (docs/design.md, "Who owns
    what"): a parameter's gradient, from the hook that takes it until it is stored, belongs to
    one backward, which *claims* its slot (``_claims``); a bucket belongs to the backward it is
    armed for; ``_lock`` guards the bookkeeping shared by all (slots, claims, the buckets being
    filled) and is never held while a gradient is stored or a consumer runs.
    """

    @staticmethod
    def shared(grad_dtype: torch.dtype) -> GradientStorage:
        """The storage of ``grad_dtype`` (a parameter's gradients have one dtype at a time)."""
        storage = _shared.get(grad_dtype)
        if storage is None:  # two threads may both get here: one storage is kept
            storage = _shared.setdefault(grad_dtype, GradientStorage(grad_dtype))
        return storage

    def __init__(self, grad_dtype: torch.dtype) -> None:
        self.grad_dtype = grad_dtype
        # The bookkeeping below. Taken inside storage work only (``deferring_releases``): a
        # finalizer that an allocation runs while it is held must not take it again.
        self._lock = threading.Lock()
        self._slots: dict[int, Slot] = {}
        self._unchecked: list[Slot] = []  # not looked up yet for a distributed engine
        self._engines_looked_up_in = -2  # the backward (graph task) that last looked them up
        # Slot -> the backward (graph task id) whose gradient it holds, from the hook that takes
        # it until it is stored (``_RELEASING`` while a release lets go of it). Claimed without
        # the lock by the hook's common case (``dict.setdefault`` is one atomic step), so other
        # threads read it through ``copy()``, which runs no Python code: ``list(d.items())``
        # makes a tuple per item, which can start the garbage collector, whose finalizers let
        # another thread's hook change the dict in the middle ("dictionary changed size").
        self._claims: dict[Slot, int] = {}
        # Gradients that arrived from another backward while a slot was claimed: added by the
        # claim's holder once it has stored its own (``_release_claims``).
        self._late: dict[Slot, list[Tensor]] = {}
        # (graph task id, device) -> the bucket that backward fills there.
        self._filling: dict[tuple[int, torch.device], Bucket] = {}
        # Graph task id -> its ``Backward``, weakly (dead: the backward ended or raised).
        self._backwards: dict[int, weakref.ref[Backward]] = {}
        self._scales = StorageScales(grad_dtype)
        self._bucket_store = BucketStore(grad_dtype, self._scales, self._backward_running)
        self._consumed = 0  # slots with a consumer
        self.work = StorageWork()  # storage methods running, per thread (``deferring_releases``)
        # Releases that came where they could not run: during storage work, from a finalizer
        # inside a trace, or while a running backward holds one of their gradients
        # (``release_when_safe``). Appended by any thread.
        self.waiting_releases: collections.deque[set[int]] = collections.deque()

    def __contains__(self, param: Tensor) -> bool:
        return id(param) in self._slots

    @deferring_releases  # a finalizer run by an allocation under the lock waits
    def held_by_other_backwards(self, held: set[int]) -> int:
        """How many parameters of ``held`` (ids) have a gradient another backward still holds.

        Claimed by a running backward other than the current thread's, and not stored yet.
        """
        if not self._claims:  # between backwards, the common case
            return 0
        current = _current_backward()
        with self._lock:
            claims = self._claims.copy()  # hooks claim slots without the lock (``_claims``)
            return sum(
                1
                for slot, owner in claims.items()
                if owner != current and id(slot.param) in held and self._running(owner)
            )

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

    @deferring_releases
    def install(self, param: Tensor, holder: set[int]) -> None:
        """Make ``param.grad`` land in ``grad_dtype``, held by ``holder``.

        Frozen parameters are left alone. A parameter another optimizer holds already keeps its
        storage, now held by both.
        """
        if id(param) in holder or not param.requires_grad:
            return
        with self._lock:
            self.check_can_manage(param)
            slot = self._slots.get(id(param))
            if slot is None:
                slot = Slot(param)
                param.grad_dtype = None  # accept a .grad whose dtype differs from the parameter's
                slot.handles.append(slot.accumulator.register_prehook(self._accumulate_hook(slot)))
                slot.cast_hook = self._cast_hook(slot)
                self._slots[id(param)] = slot
                self._unchecked.append(slot)
                _managed[param] = self
            slot.holders += 1
            holder.add(id(param))

    def _leave_to_engines(self) -> None:
        """Leave float32 the gradients of the parameters a DistributedDataParallel reduces.

        Its reducer reads each gradient right after autograd stores it and accepts only the
        parameter's dtype. Looked up once per parameter, at the first backward with a process
        group. Called with the lock held.
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
        claims = self._claims

        @run_eagerly  # called from a compiled frame (backward() inside torch.compile)
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None] | None:
            if _traced_by_dynamo():
                # Compiled autograd traces the backward into one graph: autograd stores the
                # float32 gradient, and step() takes it as the true gradient.
                return None
            # Runs for every parameter in every backward, between backward's own operations,
            # which leave the caches cold for it: each tensor attribute it reads is costly there.
            # First the claim: from here until it is stored, the gradient is this backward's
            # (another backward that brings one for the same parameter meanwhile finds it
            # claimed, in ``_take``). Then the common case: the slot's bucket is armed for this
            # backward and has room, so the hook only marks the parameter as waiting and lets
            # autograd put the float32 gradient in ``p.grad``, as it does for torch.optim; the
            # bucket's store takes it from there. Every other case goes to ``_take``.
            task = _current_backward()
            if claims.setdefault(slot, task) != task:
                sole = sole_holder(grad_outputs)  # before this frame holds the gradient
                return self._take(slot, grad_outputs[0], task, claimed=False, sole=sole)
            bucket = slot.bucket
            if (
                bucket is not None
                and bucket.task == task
                and bucket.elements
                and not slot.pending
                and bucket.elements + slot.elements <= bucket.capacity
                and param.grad is None
                and not slot.staged
            ):
                bucket.slots.append(slot)
                bucket.elements += slot.elements
                slot.pending = True
                return None  # autograd stores it, as it would without mixedopt
            sole = sole_holder(grad_outputs)
            return self._take(slot, grad_outputs[0], task, claimed=True, sole=sole)

        return hook

    def cast_hook(self, param: Tensor, dtype: torch.dtype) -> Callable[..., object] | None:
        """A pre-hook for the node of a cast of ``param`` to ``dtype``, or ``None``.

        The hook takes the gradient that reaches the cast, ``grad_dtype`` already, and hands
        the cast nothing: autograd makes no float32 copy of it (``mixedopt.autocast`` registers
        it on each weight's cast). The parameter's own hook stores it, once every use of the
        parameter in the backward has brought its gradient. ``None`` where the storage takes
        ``param``'s gradients as float32: another dtype, a parameter it does not manage or
        leaves to a distributed engine, or a gradient small enough to wait in a bucket, whose
        store reads float32 gradients.
        """
        slot = self._slots.get(id(param))
        if (
            slot is None
            or dtype != self.grad_dtype
            or slot.engine_owned
            or param.numel() <= budget(param.device).bucket_small
        ):
            return None
        return slot.cast_hook

    def _cast_hook(self, slot: Slot):  # noqa: ANN202 - autograd hook
        @run_eagerly  # called from a compiled frame (backward() inside torch.compile)
        def hook(grad_outputs: tuple[Tensor | None, ...]) -> tuple[None] | None:
            if grad_outputs[0] is None or _traced_by_dynamo():
                return None  # nothing to take, or compiled autograd's trace (``_accumulate_hook``)
            sole = sole_holder(grad_outputs)  # before this frame holds the gradient
            return self._stage(slot, grad_outputs[0], sole, _current_backward())

        return hook

    @deferring_releases
    def _stage(self, slot: Slot, incoming: Tensor, sole: bool, task: int) -> tuple[None] | None:
        """Keep a cast's 16-bit gradient in ``slot.staged`` for the parameter's hook to store.

        ``sole``: nothing else holds ``incoming`` (``_takeover.sole_holder``), so that it may
        become ``.grad`` as it is; else the store copies it.

        Claims the slot for ``task`` until then: the parameter's hook runs once the backward's
        last gradient for it has come (autograd calls it with ``None`` where every one went
        through a cast), and adds them up in arrival order, as autograd adds float32 gradients
        (``_join_staged``). ``(None,)``: taken; ``None``: left to the cast, which hands autograd
        its float32 copy, as without this hook (a parameter another running backward holds, or
        one whose gradients autograd keeps).
        """
        if not _accumulates(slot) or slot.param._backward_hooks:
            # Handed back by autograd, not accumulated, or seen first by the parameter's own
            # hooks (``p.register_hook``), which expect torch.autocast's float32 gradient: the
            # cast makes it.
            return None
        with self._lock:
            if self._claims.setdefault(slot, task) != task:
                return None  # another backward's: this gradient reaches the parameter's hook
            if self._kept_by_autograd(slot, incoming, task) or incoming.dtype != self.grad_dtype:
                if not slot.staged:
                    del self._claims[slot]
                return None
            self._backward(task)  # a backward that raises now drops what waits (_adopt_orphans)
            slot.staged.append((incoming, sole))
        return (None,)

    @staticmethod
    def _join_staged(slot: Slot, incoming: Tensor | None) -> tuple[Tensor, bool]:
        """The staged 16-bit gradients of ``slot`` and ``incoming`` as one gradient.

        ``(gradient, whether the storage may keep it as it is)``: a lone staged gradient
        itself; several, in float32, added in the order they came, then ``incoming`` (what
        reached the parameter by other ways), as autograd would add them.
        """
        staged, slot.staged = slot.staged, []
        if incoming is None and len(staged) == 1:
            return staged[0]
        total = staged[0][0].float()
        for grad, _ in staged[1:]:
            total = total + grad
        return (total if incoming is None else total + incoming), True

    @deferring_releases  # a finalizer may run in the middle of it
    def _take(
        self, slot: Slot, incoming: Tensor | None, task: int, claimed: bool, sole: bool = False
    ) -> tuple[None] | None:
        """The hook's other cases, out of its way.

        The first gradient of a backward (or of a device), one that would overflow its bucket,
        one left waiting by a backward that raised, one added to an earlier gradient, a
        gradient too large for a bucket, one another running backward has claimed (added once
        that one stored its own), and those autograd keeps: a distributed engine's, sparse ones
        (``step()`` refuses them), a parameter let go meanwhile.

        ``sole``: nothing else holds ``incoming`` (``_takeover.sole_holder``).
        """
        taken = sole  # whether ``incoming`` is the storage's own (to keep, or to scale in place)
        if claimed and slot.staged:  # what the parameter's casts handed over (``_stage``)
            incoming, taken = self._join_staged(slot, incoming)
        if incoming is None:  # nothing to store
            if claimed:
                self._release_claims([slot])
            return None
        while not claimed:
            with self._lock:
                owner = self._claims.setdefault(slot, task)
                if owner == task:
                    claimed = True
                    break
                if self._running(owner):
                    if not slot.installed or slot.engine_owned or incoming.is_sparse:
                        return None  # autograd stores it (as the claim's holder leaves it)
                    # Another backward holds this parameter's gradient: this one is added once
                    # that one is stored, by whoever stores it.
                    self._late.setdefault(slot, []).append(incoming)
                    return (None,)
                orphans = self._adopt_orphans(owner)
            self._store_and_free(orphans)  # a backward that raised left it waiting: stored first
        try:
            return self._take_claimed(slot, incoming, task, taken)
        except BaseException:
            with self._lock:  # a claim this backward still holds, its gradient in no bucket
                if self._claims.get(slot) == task and not slot.pending:
                    del self._claims[slot]
            raise

    def _take_claimed(
        self, slot: Slot, incoming: Tensor, task: int, taken: bool
    ) -> tuple[None] | None:
        """``_take`` once the slot is claimed for ``task``: hands the claim on or releases it.

        ``taken``: ``incoming`` is the storage's own (``_store_alone``).
        """
        param = slot.param
        if slot.pending:  # a second gradient in this backward: its bucket is stored first
            assert slot.bucket is not None
            self._store_bucket(slot.bucket)
            with self._lock:
                owner = self._claims.setdefault(slot, task)
            if owner != task:  # claimed meanwhile by another backward: added after it
                return self._take(slot, incoming, task, claimed=False, sole=taken)
        previous = param.grad
        with self._lock:
            if self._kept_by_autograd(slot, incoming, task):
                self._claims.pop(slot, None)
                return None  # autograd stores it
            self._backward(task)
            device = incoming.device
            numel = incoming.numel()
            limits = budget(device)
            # A bucket's store reads float32 gradients: a cast's 16-bit one is stored alone.
            small = numel <= limits.bucket_small and incoming.dtype != self.grad_dtype
            bucket = self._bucket_for(task, slot, device, limits) if small else None
        if bucket is None:
            slot.bucket = None
            try:
                self._store_alone(slot, incoming, previous, taken)
            finally:
                self._release_claims([slot])
            return (None,)
        slot.elements = rows_for(numel) * ROW  # whole rows
        slot.bucket = bucket  # the hook's common case, from now on
        if bucket.elements + slot.elements > bucket.capacity:
            self._store_bucket(bucket)  # full: stored now, and filled again
        if previous is not None:
            bucket.previous[len(bucket.slots)] = previous
        bucket.slots.append(slot)
        bucket.elements += slot.elements
        slot.pending = True
        if previous is None:
            return None  # autograd stores it in p.grad, as in the hook's common case
        param.grad = incoming  # true values until stored, as torch.optim would have them
        return (None,)  # taken: autograd stores nothing

    def _kept_by_autograd(self, slot: Slot, incoming: Tensor, task: int) -> bool:
        """Whether autograd keeps ``incoming`` (the storage stores nothing of it).

        A parameter let go, one a distributed engine reduces (looked for once per backward: a
        process group comes before it), a sparse gradient. Called with the lock held.
        """
        if self._unchecked and task != self._engines_looked_up_in:
            self._engines_looked_up_in = task
            self._leave_to_engines()
        previous = slot.param.grad
        return (
            not slot.installed
            or slot.engine_owned
            or incoming.is_sparse
            or (previous is not None and previous.is_sparse)
        )

    def _bucket_for(self, task: int, slot: Slot, device: torch.device, limits: Budget) -> Bucket:
        """The bucket ``task`` fills on ``slot``'s device, armed at its first gradient there.

        The slot's own bucket when it is free (a training loop's next backward arms the same
        one), else a new one. The backward's first bucket queues its end on the autograd
        engine (``Backward``), which stores what waits. Called with the lock held.
        """
        bucket = self._filling.get((task, device))
        if bucket is not None:
            return bucket
        bucket = slot.bucket
        if (
            bucket is None
            or bucket.task is not None
            or bucket.limits is not limits
            or bucket.device != device
        ):
            bucket = Bucket(device)  # the slot's own is in use (another backward's) or outdated
        bucket.task, bucket.owner = task, weakref.ref(self._backward(task))
        self._filling[(task, device)] = bucket
        return bucket

    def _backward(self, task: int) -> Backward:
        """The ``Backward`` of ``task``, made and queued for its end at its first gradient.

        Every backward that claims a gradient has one, so that a claim is known to be a running
        backward's (``_running``). Called with the lock held.
        """
        found = self._backwards.get(task)
        backward = None if found is None else found()
        if backward is None:
            backward = Backward(task, self._finish)
            self._backwards[task] = weakref.ref(backward)
            torch.autograd.Variable._execution_engine.queue_callback(backward)
        return backward

    def _backward_running(self) -> bool:
        """Whether a backward that brought this storage a gradient has not ended yet.

        Read without the lock (a copy of the records in one step): the bucket store asks it
        when a store ends, to keep its staging buffers for the next store or let them go.
        """
        return any(backward() is not None for backward in list(self._backwards.values()))

    def _running(self, owner: int) -> bool:
        """Whether the holder of a claim, ``owner``, may still add to or store the gradient.

        A backward that raised ran no end-of-backward callback: its ``Backward`` is dead, and its
        waiting buckets are anyone's to store. A claim with no ``Backward`` yet is a hook's, on
        its way to ``_take`` (or a release's, ``_RELEASING``). Called with the lock held.
        """
        backward = self._backwards.get(owner)
        return backward is None or backward() is not None

    def _adopt_orphans(self, task: int | None) -> list[Bucket]:
        """Take the buckets of ended backwards (``task``'s, or all) out of those being filled.

        The caller stores them (``_store_and_free``), outside the lock. Called with the lock
        held.
        """
        orphans = []
        for key, bucket in list(self._filling.items()):
            if (task is None or key[0] == task) and not bucket.running():
                del self._filling[key]
                orphans.append(bucket)
        if task is not None:
            # A claim whose gradient is in none of its buckets (a hook interrupted between
            # its claim and its bucket) ends with its backward. (The claims are copied first:
            # hooks claim slots without the lock, ``_claims``.)
            for slot, owner in self._claims.copy().items():
                if owner == task and not any(slot in bucket.slots for bucket in orphans):
                    slot.staged = []  # gradients of the backward that raised: dropped
                    del self._claims[slot]
        # Forget the ended backwards nothing refers to any more.
        holding = {held for held, _ in self._filling} | set(self._claims.values())
        for ended, backward in list(self._backwards.items()):
            if backward() is None and ended not in holding:
                del self._backwards[ended]
        return orphans

    def _store_and_free(self, buckets: list[Bucket]) -> None:
        """Store buckets no backward fills any more, then free them for the next backwards."""
        try:
            for bucket in buckets:
                self._store_bucket(bucket)
        finally:
            self._free(buckets)

    def _free(self, buckets: list[Bucket]) -> None:
        """Free stored buckets: the next backward of their slots arms them again."""
        with self._lock:
            for bucket in buckets:
                bucket.task = bucket.owner = None

    @deferring_releases
    def _finish(self, task: int) -> None:
        """The end of backward ``task``: store what waits in its buckets, and free them.

        Also what casts handed over for a parameter whose own hook never ran (``_stage`` keeps
        none where autograd does not accumulate; this is the net under it): stored, not lost,
        and no claim outlives its backward.
        """
        with self._lock:
            buckets = [b for key, b in self._filling.items() if key[0] == task]
            for bucket in buckets:
                del self._filling[(task, bucket.device)]
            claims = self._claims.copy()  # hooks claim slots without the lock (``_claims``)
            staged = [slot for slot, owner in claims.items() if owner == task and slot.staged]
        try:
            for slot in staged:
                self._take(slot, None, task, claimed=True)
            self._store_and_free(buckets)
        finally:
            # Forgotten last: a store above finds the backward it belongs to, not a new one.
            with self._lock:
                self._backwards.pop(task, None)
            self._bucket_store.release_staging()  # no staging buffer stays between backwards

    @deferring_releases  # a finalizer may run in the middle of it
    @torch.no_grad()
    def _store_bucket(self, bucket: Bucket) -> None:
        """Store what waits in ``bucket``, hand it to the consumers, and release the claims."""
        if not bucket.slots:
            return
        waiting = bucket.slots
        try:
            slots = self._bucket_store.store(bucket)
            if slots and self._consumed:
                self._hand_over(slots)
        finally:
            self._release_claims(waiting)

    @deferring_releases
    @torch.no_grad()
    def _store_alone(
        self, slot: Slot, incoming: Tensor, previous: Tensor | None, taken: bool = False
    ) -> None:
        """Store one gradient (added to ``previous``) on its own, and hand it to its consumer.

        ``taken``: nothing else holds ``incoming``: it may become ``.grad`` as it is, or be
        scaled in place.
        """
        scratch = self._bucket_store.lend_scratch(incoming.device)
        try:
            self._scales.store_alone(slot, incoming, previous, scratch, taken)
        finally:
            scratch.give_back()
        if slot.consumer is not None:
            slot.consumer([slot.param])

    def _release_claims(self, slots: list[Slot]) -> None:
        """End the claims on ``slots``, whose gradients were stored (or dropped).

        A gradient another backward brought meanwhile (``_late``) is added now, stored on its
        own by this thread, which still holds the claim: the sum is the one those backwards
        give one after the other, in the order their gradients arrived.
        """
        while slots:
            late: dict[Slot, list[Tensor]] = {}
            with self._lock:
                if self._late:
                    late = {slot: self._late.pop(slot) for slot in slots if slot in self._late}
                    slots = [slot for slot in slots if slot not in late]
                deque(map(self._claims.pop, slots, itertools.repeat(None)), maxlen=0)
            slots = []
            for slot, grads in late.items():
                try:
                    incoming = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
                    if slot.installed and not slot.engine_owned:
                        self._store_alone(slot, incoming, slot.param.grad)
                finally:
                    slots.append(slot)

    @deferring_releases
    def flush(self) -> None:
        """Store every gradient a backward that raised left waiting in a bucket.

        Those of running backwards are theirs to store, when they end.
        """
        with self._lock:
            orphans = self._adopt_orphans(None)
        try:
            self._store_and_free(orphans)
        finally:
            self._bucket_store.release_staging()  # a backward that raised left its pool

    @deferring_releases
    def set_consumer(self, params: Iterable[Tensor], consumer: Consumer | None) -> None:
        """Hand the gradients of ``params`` to ``consumer`` as soon as they are stored.

        Backward stores a bucket (or a large gradient) and calls ``consumer`` with its
        parameters at once, their ``.grad`` set; ``None`` ends it. A consumer runs inside
        backward, under ``torch.no_grad()``, on the thread that stored the gradients.
        """
        with self._lock:
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
        back (what a backward that raised left waiting is stored first). Called in the middle
        of this thread's storage work, or while a running backward holds one of their
        gradients, it runs when that ends.
        """
        if self.work.running():
            self.waiting_releases.append(holder)
            return
        self._release_now(holder)

    @run_eagerly  # the garbage collector may run it inside a compiled frame
    def release_when_safe(self, holder: set[int]) -> None:
        """``release``, for a finalizer: the garbage collector runs it wherever it happens to run.

        Inside a trace (torch.compile's, or any dispatch mode's) the tensors it would make are
        the trace's: there, as during this thread's storage work, it waits for the end of the
        next storage work (the end of a backward, the next ``step()``) or the next optimizer's
        construction, whichever comes first.
        """
        if self.work.running() or torch._C._len_torch_dispatch_stack():
            self.waiting_releases.append(holder)
            return
        self._release_now(holder)

    def release_waiting(self) -> None:
        """Run the releases that waited, unless inside a trace (they wait on)."""
        if self.work.running() or torch._C._len_torch_dispatch_stack():
            return
        for _ in range(len(self.waiting_releases)):  # those that still cannot run wait again
            try:
                holder = self.waiting_releases.popleft()
            except IndexError:  # another thread ran it
                return
            self._release_now(holder)

    @deferring_releases
    def _release_now(self, holder: set[int]) -> None:
        while True:
            with self._lock:
                leaving = [
                    slot
                    for key in holder
                    if (slot := self._slots.get(key)) is not None and slot.holders == 1
                ]
                # Claim every slot that goes: a hook under way then leaves the gradient to
                # autograd. One a running backward holds makes the release wait for it.
                taken, owner = [], None
                for slot in leaving:
                    owner = self._claims.setdefault(slot, _RELEASING)
                    if owner != _RELEASING:
                        break
                    taken.append(slot)
                else:
                    owner = None
                if owner is None:
                    self._let_go(holder, leaving)
                    return
                for slot in taken:
                    del self._claims[slot]
                if self._running(owner):
                    self.waiting_releases.append(holder)
                    return
                orphans = self._adopt_orphans(owner)
            self._store_and_free(orphans)  # what a backward that raised left: stored first

    def _let_go(self, holder: set[int], leaving: list[Slot]) -> None:
        """Drop ``holder``'s hold; uninstall ``leaving``, claimed. Called with the lock held."""
        for key in holder:
            slot = self._slots.get(key)
            if slot is not None:
                slot.holders -= 1
        holder.clear()
        for slot in leaving:
            try:
                self._uninstall(slot)
            finally:
                del self._claims[slot]
        if leaving:  # what holds the slots (and so the parameters) lets go of them too
            self._unchecked = [slot for slot in self._unchecked if slot.installed]
            self._bucket_store.forget_gone()  # their 16-bit buffers went with their .grad
        if not self._slots:  # nothing left to store: give the buffers and tables back
            self._bucket_store.clear()
            self._scales.clear()

    def _uninstall(self, slot: Slot) -> None:
        self._consumed -= slot.consumer is not None
        slot.installed = False
        slot.bucket = None
        for handle in slot.handles:
            handle.remove()
        param = slot.param
        grad = param.grad
        if grad is not None and not grad.is_sparse and not slot.engine_owned:
            true = grad.to(torch.float32, copy=True)
            scale = self.scale_of(param)
            if scale is not None:
                true.div_(scale)
            param.grad = true.to(param.dtype)
        # A parameter converted since (``model.half()``) gets its new dtype's default, which its
        # .grad has now. A release must not raise (a finalizer runs it, at exit too): where
        # torch still refuses the dtype, the parameter keeps accepting any (``None``).
        converted = param.dtype != torch.float32
        with contextlib.suppress(RuntimeError):
            param.grad_dtype = param.dtype if converted else slot.original_grad_dtype
        del self._slots[id(param)]
        if _managed.get(param) is self:
            del _managed[param]

    # ------------------------------------------------------------------ for step()

    def stats_of(self, param: Tensor) -> tuple[Tensor | None, int, bool]:
        """Where ``param.grad``'s storage scale and bound are, and whether the bound holds.

        ``(stats, row, current)``: row ``row`` of ``stats`` is ``[storage scale, bound on |true
        gradient|]`` (``stats_table`` gathers such rows). ``stats`` is ``None`` where
        ``param.grad`` holds true values (assigned by hand, not stored by this storage, or stored
        as it is), with no bound. The bound was measured when the gradient was stored (inf or
        NaN there makes it inf or NaN); it no longer holds once ``p.grad`` was changed in place.
        """
        slot = self._slots.get(id(param))
        grad = param.grad
        if slot is None or not slot.owns(grad) or slot.stats is None:
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


def cast_hook(param: Tensor, dtype: torch.dtype) -> Callable[..., object] | None:
    """``GradientStorage.cast_hook`` of the storage managing ``param``; ``None`` if none does."""
    storage = _managed.get(param)
    return None if storage is None else storage.cast_hook(param, dtype)

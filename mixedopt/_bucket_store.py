"""Bucketing: the small gradients of a backward stored together, in a fixed number of operations.

``BucketStore``, a component of ``_storage.GradientStorage``, stores a bucket into one 16-bit
buffer of which each ``p.grad`` is a view, keeps each bucket's plan of rows and views, and finds the
stored buckets again for ``step()`` (``whole_buckets``, ``stored_bucket``). See docs/design.md,
"Buckets".
"""

from __future__ import annotations

import contextlib
import itertools
import math
import operator
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ._budget import budget
from ._rows import ROW, LayoutCache, RowLayout, StoredRows, ViewRuns
from ._scales import StorageScales
from ._slots import Bucket, Slot

# Attributes of slots, parameters and gradients, read in C by ``map`` over many of them (a
# Python loop per parameter costs more than the reads themselves).
_param_of_slot = operator.attrgetter("param")
_stats_of_slot = operator.attrgetter("stats")
_ref_of_slot = operator.attrgetter("grad_ref")
_grad_of = operator.attrgetter("grad")
_stride_of = Tensor.stride  # the unbound method: half the time of methodcaller("stride")
_is_contiguous = Tensor.is_contiguous
_call = weakref.ref.__call__


class BucketPlan:
    """A bucket's layout in rows and its views, for the buckets a training loop fills again."""

    __slots__ = ("slots", "layout", "runs", "param_strides")

    def __init__(
        self,
        slots: list[Slot],
        layout: RowLayout,
        runs: ViewRuns,
        param_strides: list[Any] | None,
    ) -> None:
        # The slots it was made for, weakly: plans are found by the slots' ids, which a new slot
        # may take once one is gone.
        self.slots = tuple(map(weakref.ref, slots))
        self.layout = layout
        # The parameters' strides it was made for (``None``: all of them contiguous).
        self.param_strides = param_strides
        self.runs = runs  # each gradient's view, in its parameter's layout, of a row buffer


class StoredBucket:
    """A bucket backward stored: its stats table and 16-bit buffer (weakly held), and slots."""

    __slots__ = ("stats", "stored", "plan", "slots", "version")

    def __init__(self, stats: Tensor, stored: Tensor, plan: BucketPlan, slots: list[Slot]):
        self.stats = weakref.ref(stats)
        self.stored = weakref.ref(stored)
        self.plan = plan
        self.slots = slots  # in row order
        self.version = stored._version  # of the buffer when written


class WholeBucket:
    """A stored bucket all of whose gradients a ``step()`` takes (``whole_buckets``)."""

    __slots__ = ("stats", "params", "indices", "groups", "rows", "states")

    def __init__(
        self,
        stats: Tensor,
        params: list[Tensor],
        indices: list[int],
        stored: Tensor,
        plan: BucketPlan,
    ):
        self.stats = stats  # row i: [storage scale, bound on |true gradient|] of gradient i
        self.params = params  # the parameter of each row, in row order
        self.indices = indices  # the index of each one's group
        self.groups = set(indices)
        self.rows = StoredRows(stored, plan.layout, plan.runs)  # its 16-bit rows
        self.states: list[Any] = []  # the optimizer's state of each parameter (step())


class GroupIndex:
    """The parameter group of each parameter of an optimizer, kept between steps.

    ``whole_buckets`` needs the group of every gradient of a bucket, each step. A training
    loop's groups hold the same parameters step after step, so the groups of a bucket's rows
    (one list per ``BucketPlan``) are kept while they do; ``refresh`` checks that with a pass
    in C over each group, and starts again from the groups when they changed.
    """

    def __init__(self) -> None:
        self._groups: list[list[Tensor]] = []
        self._group_of: dict[int, int] = {}  # id(parameter) -> index of its group
        # id(plan) -> (plan, the group of each of its rows; None: one is in no group)
        self._indices: dict[int, tuple[BucketPlan, list[int] | None]] = {}

    def refresh(self, groups: list[list[Tensor]]) -> None:
        """Index ``groups`` (a list of parameters per group), unless they are the ones indexed."""
        known = self._groups
        if len(groups) == len(known) and all(
            len(params) == len(before) and all(map(operator.is_, params, before))
            for params, before in zip(groups, known, strict=True)
        ):
            return
        self._groups = [list(params) for params in groups]
        self._group_of = {}
        for index, params in enumerate(groups):
            self._group_of.update(zip(map(id, params), itertools.repeat(index)))
        self._indices = {}

    @property
    def count(self) -> int:
        """How many parameters the groups hold."""
        return len(self._group_of)

    def with_grad(self) -> int:
        """How many parameters of the groups have a gradient."""
        return sum(
            sum(map(operator.is_not, map(_grad_of, params), itertools.repeat(None)))
            for params in self._groups
        )

    def indices(self, plan: BucketPlan, params: list[Tensor]) -> list[int] | None:
        """The group of each of ``params`` (``plan``'s rows); None where one is in no group."""
        found = self._indices.get(id(plan))
        if found is not None and found[0] is plan:
            return found[1]
        group_of = self._group_of
        ids = list(map(id, params))
        indices = (
            list(map(group_of.__getitem__, ids)) if all(map(group_of.__contains__, ids)) else None
        )
        if len(self._indices) >= 64:
            self._indices.clear()
        self._indices[id(plan)] = (plan, indices)
        return indices


# What a staging buffer last held (``Staging.layout``) when it held no bucket's rows: anything
# (new memory, or scratch space, ``Staging.scratch``).
_SCRATCH = "scratch"


class Staging:
    """A float32 buffer one store works in, and what it last held.

    Owned by one store at a time: ``BucketStore.lend_staging`` (or ``lend_scratch``, for a
    store that may need none) lends it from a pool per device and takes it back when the store
    ends, so that stores running at once on several threads each have their own, and the next
    store of a backward finds a warm one; the pool lets go of it once no backward runs. Grown
    to the largest bucket stored (at most a bucket's capacity).
    """

    __slots__ = ("device", "buffer", "layout", "rows", "_views")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(0, device=device)
        # The layout whose rows it holds (its padding zero), or ``_SCRATCH``.
        self.layout: RowLayout | str = _SCRATCH
        self.rows = self.buffer
        # The gradients' views of the buffer, per plan: made once per buffer (they hold it, so
        # they go with it).
        self._views: dict[BucketPlan, list[Tensor]] = {}

    def grown(self, elements: int) -> Tensor:
        """The buffer, replaced by new memory of ``elements`` if it is shorter."""
        if self.buffer.numel() < elements:
            self.buffer = torch.empty(elements, device=self.device)
            self.layout = _SCRATCH
            self._views = {}
        return self.buffer

    def views(self, plan: BucketPlan) -> list[Tensor]:
        """The views of the buffer ``plan``'s gradients are copied into (after ``rows_for``)."""
        found = self._views.get(plan)
        if found is None:
            if len(self._views) >= 16:
                self._views.clear()
            found = self._views[plan] = plan.runs.views(self.buffer)
        return found

    def rows_for(self, layout: RowLayout) -> Tensor:
        """The buffer's rows for ``layout``, zero where they pad.

        A bucket writes its gradients where ``layout`` puts them and nothing else, so a bucket
        of the layout the buffer last had finds its padding still zero; another one zeroes the
        rows its gradients fill only in part first (none where each fills its rows).
        """
        staging = self.grown(layout.elements)
        if self.layout is not layout:
            rows = staging[: layout.elements].view(layout.rows, ROW)
            layout.zero_padding(rows)
            self.layout, self.rows = layout, rows
        return self.rows

    def scratch(self, elements: int) -> Tensor:
        """The buffer, at least ``elements`` long, as scratch space (for anything)."""
        staging = self.grown(elements)
        self.layout = _SCRATCH
        return staging


class ScratchLoan:
    """Scratch space for a store that may need none: a staging buffer borrowed at the first call.

    Made by ``BucketStore.lend_scratch``, so that a store that asks for none takes no lock.
    Owned by the store it was made for, which calls ``give_back()`` when it ends.
    """

    __slots__ = ("_store", "_device", "_staging")

    def __init__(self, store: BucketStore, device: torch.device) -> None:
        self._store = store
        self._device = device
        self._staging: Staging | None = None

    def __call__(self, elements: int) -> Tensor:
        """``Staging.scratch(elements)`` of the staging buffer lent."""
        if self._staging is None:
            self._staging = self._store._borrow_staging(self._device)
        return self._staging.scratch(elements)

    def give_back(self) -> None:
        """Give back the staging buffer, if one was borrowed."""
        if self._staging is not None:
            self._store._give_back_staging(self._staging)
            self._staging = None


class BucketStore:
    """Stores the buckets of a backward and finds them again for ``step()``; see the module.

    A component of ``_storage.GradientStorage``, which owns one per storage and hands it the
    waiting buckets. Stores run at once on several threads (one bucket each): each takes a
    staging buffer of its own from the pool; the plans and layouts are caches any of them may
    fill; the record of stored buckets is guarded by a lock.
    """

    def __init__(
        self, grad_dtype: torch.dtype, scales: StorageScales, running: Callable[[], bool]
    ) -> None:
        self.grad_dtype = grad_dtype
        self._scales = scales
        # Per device: the staging buffers no store is using (``lend_staging``), kept while a
        # backward runs (``running``), taken and given back under ``_staging_lock``.
        self._staging: dict[torch.device, list[Staging]] = {}
        self._running = running
        self._staging_lock = threading.Lock()
        self._layouts = LayoutCache()
        self._plans: dict[tuple[torch.device, tuple[int, ...]], BucketPlan] = {}
        # id(stats) -> the buckets stored, while their gradients live; changed under
        # ``_stored_lock`` (by stores, and ``clear``), read in one step.
        self._stored: dict[int, StoredBucket] = {}
        self._stored_lock = threading.Lock()

    def clear(self) -> None:
        """Give the buffers back (the storage manages no parameter any more)."""
        with self._staging_lock:
            self._staging.clear()
        self._plans.clear()
        self._layouts = LayoutCache()
        with self._stored_lock:
            self._stored.clear()

    @contextlib.contextmanager
    def lend_staging(self, device: torch.device) -> Iterator[Staging]:
        """A staging buffer of ``device`` for one store, given back to the pool after it.

        The pool keeps it for the next store while a backward runs; the store that ends the
        last one running empties the pool, so that no staging buffer stays between steps (a
        store that raised lets its buffer go).
        """
        staging = self._borrow_staging(device)
        yield staging
        self._give_back_staging(staging)

    def lend_scratch(self, device: torch.device) -> ScratchLoan:
        """Scratch space of ``device`` for one store, borrowed only if the store asks for it.

        The store calls ``give_back()`` on it when it ends (as ``lend_staging`` does).
        """
        return ScratchLoan(self, device)

    def _borrow_staging(self, device: torch.device) -> Staging:
        with self._staging_lock:
            pool = self._staging.setdefault(device, [])
            return pool.pop() if pool else Staging(device)  # none free: one more

    def _give_back_staging(self, staging: Staging) -> None:
        # Under the lock with the check: a store that ends the last backward empties the pool
        # after any other store put its buffer back.
        with self._staging_lock:
            pool = self._staging.setdefault(staging.device, [])
            if self._running():
                pool.append(staging)
            else:
                pool.clear()

    def release_staging(self) -> None:
        """Empty the pool of staging buffers unless a backward runs (one has just ended)."""
        with self._staging_lock:
            if not self._running():
                self._staging.clear()

    def store(self, bucket: Bucket) -> list[Slot]:
        """Store a bucket's gradients: a fixed number of operations for all of them.

        Returns the slots stored (none where every waiting gradient was cleared). Runs under
        ``torch.no_grad()`` (the storage's ``_store_bucket``).
        """
        slots, grads, previous = bucket.take_waiting()
        if not slots:
            return slots
        plan = self._plan(slots, bucket.device)
        with self.lend_staging(bucket.device) as staging:
            self._write(staging, plan, slots, grads, previous)
        return slots

    def _write(
        self,
        staging: Staging,
        plan: BucketPlan,
        slots: list[Slot],
        grads: list[Tensor],
        previous: dict[int, Tensor],
    ) -> None:
        """Write a bucket's gradients, scaled, into one 16-bit buffer, through ``staging``.

        Empties ``grads``: the float32 gradients go with their ``p.grad``, replaced here.
        """
        device = staging.device
        layout = plan.layout
        rows = staging.rows_for(layout)
        views = staging.views(plan)
        torch._foreach_copy_(views, grads)
        grads.clear()
        if previous:
            added = list(previous)
            earlier = list(previous.values())
            inverse = self._scales.inverse([slots[i] for i in added], earlier)
            torch._foreach_addcmul_([views[i] for i in added], earlier, inverse)
        # Largest magnitude per tensor (NaN and inf propagate), then the scales.
        on_host = budget(device).on_host
        if on_host:
            # Two reductions rather than abs(): no temporary of the bucket's size, and many
            # times faster on a CPU than an inf-norm per row.
            row_max = torch.maximum(rows.amax(dim=1), -rows.amin(dim=1))
        else:
            row_max = torch.linalg.vector_norm(rows, math.inf, dim=1)  # one launch
        amax = layout.per_tensor_max(row_max)
        scales = self._scales.for_magnitudes(amax)
        if on_host:
            # Scale in float32 in place (the staging rows are not needed after), then round to
            # grad_dtype into a new buffer of rows: two vectorised passes, faster on a CPU than
            # one multiplication into a 16-bit output, which computes into a float32
            # temporary first.
            rows.mul_(layout.per_row(scales))
            stored = rows.to(self.grad_dtype)
        else:
            stored = torch.empty(rows.shape, dtype=self.grad_dtype, device=device)
            torch.mul(rows, layout.per_row(scales), out=stored)  # one launch
        stats = torch.stack([scales, amax], dim=1)
        self._remember(stats, stored, plan, slots)
        version = stored._version
        reference = weakref.ref
        # One view of ``stored`` per parameter, in its layout (the loop runs per parameter: its
        # body is kept to the bookkeeping).
        for row, (slot, grad) in enumerate(zip(slots, plan.runs.views(stored), strict=True)):
            slot.param.grad = grad
            slot.grad_ref = reference(grad)
            slot.grad_version, slot.stats, slot.row = version, stats, row
            slot.pending = False

    def _remember(self, stats: Tensor, stored: Tensor, plan: BucketPlan, slots: list[Slot]) -> None:
        """Keep where a bucket was stored, while its gradients live (``stored_bucket``)."""
        record = StoredBucket(stats, stored, plan, slots)
        with self._stored_lock:
            self._forget_gone()
            self._stored[id(stats)] = record

    def forget_gone(self) -> None:
        """Forget the stored buckets whose buffers are gone (a record holds its parameters)."""
        with self._stored_lock:
            self._forget_gone()

    def _forget_gone(self) -> None:
        found = self._stored
        for key in [k for k, old in found.items() if old.stored() is None]:
            del found[key]

    def stored_bucket(self, stats: Tensor) -> StoredRows | None:
        """The 16-bit buffer of rows the gradients of ``stats`` are views of, with its layout.

        Row ``i`` of ``stats`` is the ``i``-th view. ``None`` once the gradients are gone.
        """
        record = self._stored.get(id(stats))
        if record is None or record.stats() is not stats:
            return None
        stored = record.stored()
        return None if stored is None else StoredRows(stored, record.plan.layout, record.plan.runs)

    def whole_buckets(self, groups: GroupIndex) -> tuple[list[WholeBucket], int]:
        """The stored buckets whose every gradient is the ``.grad`` of a parameter of ``groups``.

        Only buckets whose gradients are all still the views this storage wrote, unchanged
        since (the views share one version counter), qualify; each comes with its parameters
        in row order and the index of their group. Also how many parameters of ``groups`` have
        a gradient outside them. Each check is one pass in C over a bucket's slots (``map``
        over attribute getters), not a Python step per parameter: ``step()`` takes the
        buckets from here without looking each parameter up again.
        """
        if not self._stored:
            return [], groups.with_grad()
        # A copy in one step (``list``), without the lock, which only stores take: a release
        # that the garbage collector runs here (not storage work) may clear the records.
        records = list(self._stored.values())
        whole = []
        taken = 0
        for record in records:
            stats, stored, slots = record.stats(), record.stored(), record.slots
            if stats is None or stored is None or stored._version != record.version:
                continue
            params = list(map(_param_of_slot, slots))
            indices = groups.indices(record.plan, params)
            if indices is None:
                continue
            grads = list(map(_grad_of, params))
            if not (
                # every parameter is of ``groups``, last stored in this bucket, and its .grad
                # is still the view written there: not None (a view that is gone and a
                # gradient set to None are both None, while the buffer lives on, held by
                # whatever else reads it, another thread's step among them)
                all(map(operator.is_, map(_stats_of_slot, slots), itertools.repeat(stats)))
                and all(map(operator.is_not, grads, itertools.repeat(None)))
                and all(map(operator.is_, grads, map(_call, map(_ref_of_slot, slots))))
            ):
                continue
            whole.append(WholeBucket(stats, params, indices, stored, record.plan))
            taken += len(params)
        if taken == groups.count:  # every parameter's gradient is in a whole bucket
            return whole, 0
        return whole, groups.with_grad() - taken

    def _plan(self, slots: list[Slot], device: torch.device) -> BucketPlan:
        """Where the gradients of ``slots`` go, kept: a training loop fills the same buckets."""
        key = (device, tuple(map(id, slots)))
        plan = self._plans.get(key)
        params = list(map(_param_of_slot, slots))
        contiguous = all(map(_is_contiguous, params))
        # Made for the parameters' memory as it was: new memory (``p.data = ...``) needs a new
        # plan. Contiguous parameters that still are (the common case) are checked without
        # reading their strides.
        if (
            plan is not None
            and all(map(operator.is_, map(_call, plan.slots), slots))
            and (
                contiguous
                if plan.param_strides is None
                else plan.param_strides == list(map(_stride_of, params))
            )
        ):
            return plan
        if len(self._plans) >= 16:
            self._plans.clear()
        strides = [slot.grad_strides() for slot in slots]
        layout = self._layouts.get([slot.param.numel() for slot in slots], device)
        runs = ViewRuns([slot.shape for slot in slots], strides, layout.offsets)
        param_strides = None if contiguous else list(map(_stride_of, params))
        plan = self._plans[key] = BucketPlan(slots, layout, runs, param_strides)
        return plan

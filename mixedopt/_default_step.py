"""The default update: torch's functional update on float32 gradients, in bounded batches.

Parameters are taken whole in batches of at most ``budget(device).piece`` elements (a larger one
cut into 1-D pieces); a batch's gradients are upcast and unscaled into a float32 buffer and go to
``rmsprop()``, ``adam()`` or ``sgd()`` as lists. Whole buckets are upcast by their rows
(``upcast_stored``, ``stored_batches``); ``batches`` is the reference they are tested against.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

import torch
from torch import Tensor

from ._budget import budget
from ._distributed import local
from ._entries import Entry
from ._rows import StoredRows
from ._strides import dense_order, dense_strides, flat_view, view_in
from ._workspace import Workspace

# The parent's functional update: (params, grads, states by key, step counters).
Update = Callable[[list[Tensor], list[Tensor], dict[str, list[Any]], list[Tensor]], None]
# GradientStorage.stored_bucket: a bucket's 16-bit rows, layout and views, from its stats table.
StoredRowsLookup = Callable[[Tensor], StoredRows | None]


class Batch:
    """What one call of the functional update takes, as parallel lists.

    Its gradients are those of the entries from ``first`` on, one each, in order: a batch holds
    at most one piece of a parameter.
    """

    __slots__ = ("first", "params", "grads", "states", "steps", "created")

    def __init__(self, first: int, keys: int) -> None:
        self.first = first
        self.params: list[Tensor] = []
        self.grads: list[Tensor] = []  # float16/bfloat16 (scaled) or float32, shaped as params
        self.states: list[list[Tensor | None]] = [[] for _ in range(keys)]  # None: created
        self.steps: list[Tensor] = []
        # (state key index, position, destination) of each state the functional creates.
        self.created: list[tuple[int, int, Tensor]] = []

    def add(
        self,
        param: Tensor,
        grad: Tensor,
        states: Sequence[Tensor | None],
        created: dict[int, Tensor],
        step: Tensor | None,
    ) -> None:
        position = len(self.params)
        self.params.append(param)
        self.grads.append(grad)
        for j, value in enumerate(states):
            self.states[j].append(value)
        for j, destination in created.items():
            self.created.append((j, position, destination))
        if step is not None:
            self.steps.append(step)

    def copy_created(self) -> None:
        """Copy the state the functional created into its place."""
        for j, position, destination in self.created:
            destination.copy_(self.states[j][position])  # type: ignore[arg-type]


def _pieces(
    entry: Entry, keys: Sequence[str], capacity: int, cut: bool = True
) -> Iterator[tuple[Tensor, Tensor, list[Tensor | None], dict[int, Tensor], Tensor | None]]:
    """A large or sharded parameter, whole (its rank's shard) or in 1-D pieces.

    Pieces have at most ``capacity`` elements; a parameter is cut when weights, gradient and
    state are dense in one layout (its pieces are then views: nothing is copied), and ``cut``
    (an update that needs the whole parameter, Adafactor's or Muon's, is not cut).
    """
    param, grad = local(entry.param), local(entry.grad)
    states: list[Tensor | None] = [local(entry.state.get(key)) for key in keys]
    created = {j: local(entry.created[key]) for j, key in enumerate(keys) if key in entry.created}
    step = entry.state.get("step")
    order = dense_order(param) if cut and param.numel() > capacity else None
    if order is None:
        yield param, grad, states, created, step
        return
    # A state that does not exist yet has its destination in ``created`` (``_reference_step`` makes
    # one for each that the update creates): no target is None.
    targets = cast("list[Tensor]", [created.get(j, s) for j, s in enumerate(states)])
    # Elementwise state is cut with the parameter; a 0-dim one is a scalar of the whole
    # parameter (NAdam's mu_product, ASGD's eta and mu), which each piece reads.
    elementwise = [j for j, target in enumerate(targets) if target.dim() > 0]
    flats = [flat_view(t, order) for t in (param, *(targets[j] for j in elementwise), grad)]
    if any(f is None for f in flats):
        yield param, grad, states, created, step
        return
    # Every piece of every tensor at once (``split`` makes its views in C++).
    pieces = [flat.split(capacity) for flat in flats]  # type: ignore[union-attr]
    last = len(pieces[0]) - 1
    for i, (param_piece, *cut_pieces, grad_piece) in enumerate(zip(*pieces, strict=True)):
        # A counter, and a scalar of the parameter, advances once per parameter: earlier
        # pieces advance copies.
        of_piece = dict(zip(elementwise, cut_pieces, strict=True))
        values = [
            of_piece[j] if j in of_piece else t if i == last else t.clone()
            for j, t in enumerate(targets)
        ]
        yield (
            param_piece,
            grad_piece,
            [None if j in created else value for j, value in enumerate(values)],
            {j: values[j] for j in created},
            step if step is None or i == last else step.clone(),
        )


def batches(
    entries: Sequence[Entry], keys: Sequence[str], capacity: int, cut: bool = True
) -> Iterator[Batch]:
    """The parameters of ``entries``, in order, in batches of at most ``capacity`` elements.

    A batch holds more only when it is one parameter that cannot be cut (or, without ``cut``,
    is not to be: an update that needs whole parameters).
    """
    count = len(keys)
    batch = Batch(0, count)
    filled = 0
    for index, e in enumerate(entries):
        numel = e.param.numel()
        if numel <= capacity and not e.sharded:
            # The common case, kept to plain list appends: it runs once per parameter.
            if batch.params and filled + numel > capacity:
                yield batch
                batch, filled = Batch(index, count), 0
            state = e.state
            values = [state.get(key) for key in keys]
            created = {}
            if e.created:
                created = {j: e.created[k] for j, k in enumerate(keys) if values[j] is None}
            batch.add(e.param, e.grad, values, created, state.get("step"))
            filled += numel
            continue
        for param, grad, states, created, step in _pieces(e, keys, capacity, cut):
            size = param.numel()
            if batch.params and filled + size > capacity:
                yield batch
                batch, filled = Batch(index, count), 0
            batch.add(param, grad, states, created, step)
            filled += size
    if batch.params:
        yield batch


def _upcast(workspace: Workspace, batch: Batch, factors: Tensor | None) -> list[Tensor]:
    """Float32 ``grad * factor`` for each gradient of ``batch``.

    ``factors`` holds one per entry of the step: the batch's are from ``batch.first`` on.
    ``None``: each is exactly 1, and the upcast is all.
    """
    if len(batch.params) == 1:  # a piece of a large parameter, mostly
        factor = None if factors is None else factors[batch.first]
        return [_upcast_one(workspace, batch.params[0], batch.grads[0], factor)]
    if factors is not None:
        factors = factors[batch.first : batch.first + len(batch.params)]
    return _upcast_rows(workspace, batch, factors)


def _upcast_rows(workspace: Workspace, batch: Batch, factors: Tensor | None) -> list[Tensor]:
    """``_upcast`` in a buffer of rows: one copy and one multiplication for all gradients."""
    device = batch.params[0].device
    layout = workspace.layout([p.numel() for p in batch.params], device)
    rows, views = workspace.rows("grad", torch.float32, layout, batch.params)
    torch._foreach_copy_(views, batch.grads)
    if factors is not None:
        rows.mul_(layout.per_row(factors))  # unscale in float32, one factor per gradient
    return views


def _upcast_one(workspace: Workspace, param: Tensor, grad: Tensor, factor: Tensor | None) -> Tensor:
    """``_upcast`` of one gradient, multiplied by its factor as a scalar (``None``: 1).

    ``factor`` is 0-dim (a scalar to a CPU kernel): no column of it gathered per row.
    """
    strides = dense_strides(param)
    device = param.device
    if param.numel() > budget(device).piece:  # a parameter that cannot be cut: not kept
        upcast = torch.empty_strided(param.shape, strides, device=device)
    else:
        buffer = workspace.buffer("grad", torch.float32, device, param.numel())
        upcast = view_in(buffer, 0, param, strides)
    upcast.copy_(grad)
    return upcast if factor is None else upcast.mul_(factor)


def upcast_stored(
    workspace: Workspace,
    buckets: Sequence[StoredRows],
    factors: Tensor | None,
    stats: Tensor | None = None,
) -> list[Tensor]:
    """Float32 ``grad * factor`` of each gradient of stored buckets (``factors`` one each).

    Views of one float32 buffer in the buckets' layouts, one after the other, written from
    their 16-bit rows (``stored``, ``layout.rows x ROW``) with one copy for all.
    ``factors=None``: every factor is 1, and the copy is all; with ``stats`` (the buckets'
    stats tables, joined) each gradient is divided by its storage scale instead, which gives
    what multiplying by its inverse does (a power of two), in two operations fewer.
    """
    device = buckets[0].stored.device
    plans = [(bucket.layout, bucket.runs) for bucket in buckets]
    rows, parts, grads = workspace.run_views("grad", torch.float32, plans, device)
    # A copy, then a float32 multiplication (or division): faster on a CPU than one operation
    # from 16-bit inputs, which does not vectorise there.
    if len(buckets) == 1:
        rows.copy_(buckets[0].stored)
    else:
        torch._foreach_copy_(parts, [bucket.stored for bucket in buckets])
    if factors is None and stats is None:
        return grads
    layout = buckets[0].layout
    if len(buckets) > 1:
        layout = workspace.layout([n for part, _ in plans for n in part.numels], device)
    if factors is not None:
        rows.mul_(layout.per_row(factors))
    elif stats is not None:
        rows.div_(layout.per_row_first(stats.to(device)))
    return grads


def stored_batches(buckets: Sequence[StoredRows], piece: int) -> list[list[int]]:
    """The indices of ``buckets``, in order, in batches of at most ``piece`` elements.

    A batch is of one device; a bucket larger than ``piece`` is a batch of its own.
    """
    found: list[list[int]] = []
    filled = 0
    device = None
    for i, bucket in enumerate(buckets):
        elements = bucket.layout.elements
        if not found or filled + elements > piece or bucket.stored.device != device:
            found.append([])
            filled, device = 0, bucket.stored.device
        found[-1].append(i)
        filled += elements
    return found


def _whole_buckets(
    entries: list[Entry], stored_bucket: StoredRowsLookup, device: torch.device
) -> tuple[list[tuple[list[int], StoredRows]], list[int]]:
    """The buckets of ``entries`` that can be upcast from their rows, and the other entries.

    A bucket qualifies when every gradient it stored is one of ``entries``, untouched since
    backward stored it, with state to update. Each comes as ``(positions in row order, its
    rows)``; the others as their positions.
    """
    by_bucket: dict[int, list[int]] = {}
    for i, e in enumerate(entries):
        if e.stats is not None and e.amax_current and not e.created and not e.sharded:
            by_bucket.setdefault(id(e.stats), []).append(i)
    whole, taken = [], set()
    for positions in by_bucket.values():
        stats = entries[positions[0]].stats
        assert stats is not None
        found = stored_bucket(stats) if len(positions) == stats.shape[0] else None
        if found is None or found.stored.device != device:
            continue
        ordered = [0] * len(positions)
        for i in positions:
            ordered[entries[i].row] = i
        whole.append((ordered, found))
        taken.update(positions)
    return whole, [i for i in range(len(entries)) if i not in taken]


def default_update(
    update: Update,
    keys: Sequence[str],
    entries: list[Entry],
    factors: Tensor,
    workspace: Workspace,
    stored_bucket: StoredRowsLookup | None = None,
    cut: bool = True,
    unscaled: bool = False,
) -> None:
    """Update ``entries`` (all on one device; ``factors`` one each) on the default path.

    With ``stored_bucket``, the gradients of the buckets backward stored are upcast straight
    from their 16-bit buffers, buckets joined into batches (``stored_batches``, one copy and one
    multiplication a batch); the others are taken in batches (``batches``), the reference
    path. Without ``cut``, no parameter is cut into pieces (``_pieces``). ``unscaled``: no loss
    scale and no clipping, so that a gradient of true values (``Entry.true_values``) has a
    factor of exactly 1; those are upcast with no multiplication, batched apart.
    """
    device = entries[0].param.device
    piece = budget(device).piece
    rest = list(range(len(entries)))
    if stored_bucket is not None:
        whole, rest = _whole_buckets(entries, stored_bucket, device)
        for joined in stored_batches([rows for _, rows in whole], piece):
            ordered = [i for b in joined for i in whole[b][0]]
            chosen = [entries[i] for i in ordered]
            bucket_factors = None
            if not (unscaled and all(e.true_values for e in chosen)):
                bucket_factors = factors[workspace.index(ordered, device)]
            grads = upcast_stored(workspace, [whole[b][1] for b in joined], bucket_factors)
            states = {key: [e.state.get(key) for e in chosen] for key in keys}
            steps = [step for e in chosen if (step := e.state.get("step")) is not None]
            update([e.param for e in chosen], grads, states, steps)
        if not rest:
            return
    exact: list[int] = []
    scaled = rest
    if unscaled:
        exact = [i for i in rest if entries[i].true_values]
        if exact:
            apart = set(exact)
            scaled = [i for i in rest if i not in apart]
    # All batches are made before the first update: Python run between the update's large
    # memory passes finds its data evicted from the caches and runs several times slower
    # (docs/performance.md). A batch holds views, and nothing else
    # of a tensor's size (``_pieces``).
    found: list[tuple[Batch, Tensor | None]] = []
    for run, run_factors in ((exact, None), (scaled, factors)):
        if not run:
            continue
        if run_factors is not None and len(run) != len(entries):
            run_factors = run_factors[workspace.index(run, device)]
        chosen = entries if len(run) == len(entries) else [entries[i] for i in run]
        found += [(batch, run_factors) for batch in batches(chosen, keys, piece, cut)]
    for batch, batch_factors in found:
        grads = _upcast(workspace, batch, batch_factors)
        update(batch.params, grads, dict(zip(keys, batch.states, strict=True)), batch.steps)
        batch.copy_created()
        del grads  # before the next batch's: one parameter's upcast at a time

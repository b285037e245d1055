"""Stepping in backward: stored gradients update their parameters batch by batch, in backward.

``UpdatingBackward`` is the context ``optimizer.step_in_backward()`` returns. It gathers the
buckets the storage hands it and calls the update its optimizer gave it on each batch (the
same weights as ``step()``); at its end it calls ``step()`` once. What needs every gradient first
(``max_grad_norm``, GradScaler) is refused. See docs/design.md, "Stepping in backward".
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import Tensor

from ._distributed import ddp_managed, is_dtensor
from ._eager import run_eagerly

# Elements of 16-bit gradients that wait to be updated together (8 MiB): the bound on the
# gradients an updating backward holds, beyond one bucket or one larger gradient. Updating
# parameters one by one between backward's matrix products costs more than the update itself on
# a CPU (each update evicts from the caches what backward works on next: docs/performance.md)
# and a launch per update on an accelerator; updated together they cost what step() costs.
UPDATE_BATCH = 1 << 22

if TYPE_CHECKING:
    from ._storage import GradientStorage


class UpdatesInBackward(Protocol):
    """What ``UpdatingBackward`` needs of its optimizer: torch's API and two mixedopt attributes."""

    param_groups: list[dict[str, Any]]
    max_grad_norm: float | None

    @property
    def skipped_steps(self) -> int: ...

    def step(self) -> Any: ...


# Updates a list per param group of parameters as step() would; False: nothing updated (inf/NaN).
UpdateInBackward = Callable[[list[list[Tensor]]], bool]


class InBackwardState:
    """An optimizer's side of ``step_in_backward()``, which the optimizer keeps."""

    __slots__ = ("mode", "updated", "ddp_checked", "storage_removed", "skipped")

    def __init__(self) -> None:
        self.mode: UpdatingBackward | None = None  # the mode when on
        self.updated = False  # a backward in the mode updated the weights since the last step()
        self.ddp_checked = False  # DistributedDataParallel was looked for
        self.storage_removed = False  # remove_grad_storage() was called
        self.skipped = 0  # backwards whose updates an inf or NaN stopped


def grad_scaler_error(optimizer: Any) -> RuntimeError:
    name = type(optimizer).__name__
    return RuntimeError(
        f"GradScaler stepped mixedopt.{name} after a step_in_backward() backward, which had "
        "already updated the weights with the gradients of the loss GradScaler scaled: "
        "GradScaler's skip-on-inf needs every gradient before the first update, so the two "
        "cannot be combined. Drop GradScaler (mixedopt's float16 gradients carry their own "
        "per-tensor scale) or step with loss.backward(); optimizer.step()"
    )


class UpdatingBackward:
    """The context ``step_in_backward()`` returns: the backwards in it update the weights.

    Made by ``MixedPrecisionOptimizer.step_in_backward()``, not by hand. Entering it checks what
    the mode refuses (a ``RuntimeError`` that says why); leaving it calls ``step()`` once.

    Args:
        optimizer: the optimizer whose parameters the backwards update.
        storage: the gradient storage that hands it the stored gradients.
        state: the optimizer's side of the mode (whether it is on, backwards stopped by inf/NaN).
        update: updates a batch of parameters whose gradients were stored, as ``step()`` would.
    """

    def __init__(
        self,
        optimizer: UpdatesInBackward,
        storage: GradientStorage,
        state: InBackwardState,
        update: UpdateInBackward,
    ) -> None:
        self.optimizer = optimizer
        self.update = update
        self.storage = storage
        self.state = state
        groups = optimizer.param_groups
        self.params = [p for group in groups for p in group["params"]]
        self.group_of = {id(p): i for i, group in enumerate(groups) for p in group["params"]}
        # Autograd runs each device's hooks on a thread of its own: one update at a time (they
        # share the optimizer's state and buffers).
        self.lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self.updated = 0  # parameters this backward updated
        self.discarded = 0  # parameters whose gradient an inf/NaN made this backward discard
        self.stopped = False  # an inf or NaN was met: nothing more is updated
        self.waiting: list[Tensor] = []  # stored gradients not updated yet (``UPDATE_BATCH``)
        self.waiting_elements = 0
        self.task = -1  # the backward whose end updates what waits

    def _refuse(self, why: str) -> None:
        name = type(self.optimizer).__name__
        raise RuntimeError(f"mixedopt.{name}.step_in_backward(): {why}")

    def _check(self) -> None:
        optimizer, storage, state = self.optimizer, self.storage, self.state
        if state.mode is not None:
            self._refuse(
                "already on: its with block was entered again inside itself; a backward in it "
                "updates the weights once, so one block is enough"
            )
        if optimizer.max_grad_norm is not None:
            self._refuse(
                "max_grad_norm clips by the norm of all gradients, known only when backward "
                "ends, after the updates; clip with loss.backward(); optimizer.step(), or set "
                "max_grad_norm=None"
            )
        if state.storage_removed:
            self._refuse(
                "remove_grad_storage() was called, so backward no longer hands the gradients to "
                "the optimizer; use loss.backward(); optimizer.step()"
            )
        if any(is_dtensor(p) for p in self.params):
            self._refuse(
                "FSDP2 (fully_shard) owns the gradients of its sharded parameters and "
                "reduce-scatters them after backward; step with loss.backward(); "
                "optimizer.step()"
            )
        # Looked for once per optimizer (a walk over the objects the collector tracks); the
        # storage also knows the parameters it found DDP to reduce at a backward.
        if not state.ddp_checked:
            state.ddp_checked = True
            ddp = bool(ddp_managed(self.params))
        else:
            ddp = any(storage.left_to_engine(p) for p in self.params)
        if ddp:
            self._refuse(
                "DistributedDataParallel owns the gradients of its parameters and all-reduces "
                "them after backward; step with loss.backward(); optimizer.step()"
            )
        shared = [p for p in self.params if storage.holders(p) > 1]
        if shared:
            self._refuse(
                f"{len(shared)} parameter(s) are also held by another mixedopt optimizer, and "
                "a gradient this mode uses is freed; give each optimizer its own parameters"
            )

    def __enter__(self) -> UpdatingBackward:
        self._check()
        self._reset()  # the same context may be entered again
        self.state.mode = self
        self.storage.set_consumer(self.params, self.consume)
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        optimizer, storage = self.optimizer, self.storage
        storage.set_consumer(self.params, None)
        self.state.mode = None
        storage.flush()  # what a backward that raised left waiting: stored, not used
        if kind is not None:
            self.waiting, self.waiting_elements = [], 0  # stored, not used, likewise
            return
        if self.stopped:
            self._discard([p for p in self.params if p.grad is not None])
            self.state.skipped += 1
            name = type(optimizer).__name__
            warnings.warn(
                f"mixedopt.{name}: a gradient was inf or NaN in a step_in_backward() backward; "
                f"{self.updated} parameter(s) had been updated before it was found, the other "
                f"{self.discarded} keep their weights and state and their gradients were "
                f"discarded ({optimizer.skipped_steps} skipped so far)",
                RuntimeWarning,
                stacklevel=2,
            )
        # The parameters with a gradient from earlier micro-batches only, the step hooks, and
        # the LR schedulers that check that step() was called.
        left = [p for p in self.params if p.grad is not None]
        optimizer.step()
        for p in left:
            p.grad = None
        self.state.updated = True

    def _discard(self, params: list[Tensor]) -> None:
        for p in params:
            p.grad = None
        self.discarded += len(params)

    @torch.no_grad()
    def consume(self, params: list[Tensor]) -> None:
        """Take ``params``, whose gradients backward has just stored, for an update.

        Called by the gradient storage while the context is entered. They wait with those taken
        before until the next would take the waiting gradients past ``UPDATE_BATCH`` elements,
        or until the backward under way ends (a callback queued on the autograd engine); then
        the waiting parameters are updated and their gradients freed.

        Args:
            params: parameters of the optimizer whose gradients were just stored.
        """
        with self.lock:
            if self.stopped:
                self._discard(params)
                return
            elements = sum(map(Tensor.numel, params))
            if self.waiting and self.waiting_elements + elements > UPDATE_BATCH:
                self._update_waiting()
            self.waiting += params
            self.waiting_elements += elements
            task = torch._C._current_graph_task_id()
            # -1: not in a backward. Past the batch: a bucket or a gradient larger than it alone.
            if task == -1 or self.waiting_elements > UPDATE_BATCH:
                self._update_waiting()
            elif task != self.task:
                self.task = task
                torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    @run_eagerly  # called from the frame that ran backward(), which may be compiled
    def _end_of_backward(self) -> None:
        # As storage work, as in ``consume``: a release that comes in the middle of the update
        # (a finalizer: the garbage collector may run there) stores what waits in the shared
        # storage, which hands it to ``consume``; it must wait until the lock is free.
        self.storage.run_as_storage_work(self._update_at_end)

    @torch.no_grad()
    def _update_at_end(self) -> None:
        with self.lock:
            self.task = -1
            self._update_waiting()

    def _update_waiting(self) -> None:
        params, self.waiting, self.waiting_elements = self.waiting, [], 0
        if params:
            self._update(params)

    def _update(self, params: list[Tensor]) -> None:
        if self.stopped:
            self._discard(params)
            return
        by_group: list[list[Tensor]] = [[] for _ in self.optimizer.param_groups]
        for p in params:
            by_group[self.group_of[id(p)]].append(p)
        if not self.update(by_group):
            self.stopped = True
            self._discard(params)
            return
        for p in params:
            p.grad = None
        self.updated += len(params)

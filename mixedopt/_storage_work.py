"""Storage work: what an optimizer's release, coming in the middle of it, waits for.

Optimizers let go of their parameters from a finalizer, which runs whenever the garbage
collector does, possibly inside the storage's own work on the same thread. ``deferring_releases``
marks that work; ``StorageWork`` counts it per thread.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any, Protocol

from ._eager import run_eagerly


class StorageWork(threading.local):
    """How deep the current thread is in the storage's work (each thread has its own count).

    Owned by a thread: a release that comes from the garbage collector in the middle of this
    thread's storage work waits for it to end; other threads' work does not concern it.
    """

    depth = 0  # the class attribute is each thread's start

    def running(self) -> bool:
        """Whether the current thread is inside storage work."""
        return self.depth > 0


class DefersReleases(Protocol):
    """A storage whose work ``deferring_releases`` marks."""

    work: StorageWork  # storage work running on each thread (nested calls count each)
    waiting_releases: Any  # the releases that came where they could not run

    def release_waiting(self) -> None: ...


def deferring_releases(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``method`` as storage work: a ``release`` that comes in the middle of it waits.

    Optimizers let go of their parameters from a finalizer, which runs whenever the garbage
    collector does: inside a store, or inside the consumer a store calls (an update of
    ``step_in_backward``, which may compile), or while the storage's lock is held. Releasing
    there would store again what is being stored, call that consumer from inside itself, or
    wait for a lock its own thread holds. The release runs when the thread's outermost such
    method returns (``GradientStorage.release_waiting``).
    """

    @functools.wraps(method)
    def working(self: DefersReleases, *args: Any, **kwargs: Any) -> Any:
        work = self.work
        depth = work.depth
        work.depth = depth + 1
        try:
            return method(self, *args, **kwargs)
        finally:
            work.depth = depth
            if not depth and self.waiting_releases:
                self.release_waiting()

    run_eagerly(working)  # the end of a backward calls ``finish`` from the frame that ran it
    return working

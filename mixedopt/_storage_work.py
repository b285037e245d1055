"""Storage work: what an optimizer's release, coming in the middle of it, waits for.

Optimizers let go of their parameters from a finalizer, which runs whenever the garbage
collector does, possibly inside the storage's own work. ``deferring_releases`` marks that work.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Protocol

from ._eager import run_eagerly


class DefersReleases(Protocol):
    """A storage whose work ``deferring_releases`` marks."""

    working: int  # storage work running (nested calls count each)
    waiting_releases: Any  # the releases that came during it

    def release_waiting(self) -> None: ...


def deferring_releases(method: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``method`` as storage work: a ``release`` that comes in the middle of it waits.

    Optimizers let go of their parameters from a finalizer, which runs whenever the garbage
    collector does: inside a store, or inside the consumer a store calls (an update of
    ``step_in_backward``, which may compile). Storing there would store again what is being
    stored, or call that consumer from inside itself. The release runs when the outermost
    such method returns (``GradientStorage.release_waiting``).
    """

    @functools.wraps(method)
    def working(self: DefersReleases, *args: Any, **kwargs: Any) -> Any:
        self.working += 1
        try:
            return method(self, *args, **kwargs)
        finally:
            self.working -= 1
            if not self.working and self.waiting_releases:
                self.release_waiting()

    run_eagerly(working)  # the end of a backward calls ``flush`` from the frame that ran it
    return working

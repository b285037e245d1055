"""What the step's components need of their optimizer: torch's API and an optimizer file's rules.

An optimizer file (``rmsprop.py``, ``adam.py``, ...) says how its state is created and which
functional update and compiled kernel it calls; ``MixedPrecisionOptimizer`` gives the defaults.
The components of ``step()`` (``_stages.StepStages`` and the paths it holds) see their optimizer
through this protocol only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from torch import Tensor


class UpdateRules(Protocol):
    """An optimizer, as the components of its step see it."""

    param_groups: list[dict[str, Any]]
    state: Any  # torch.optim's per-parameter state
    _parent_has_torch_fused: bool  # the parent's functional update has a fused implementation
    _compiled_kernel: Callable[..., None] | None  # ``_compiled.py``'s kernel, if it has one
    _compiled_state_order: tuple[str, ...]  # its state arguments, in order
    _updates_whole_parameters: bool  # the update needs each parameter whole (never cut)

    def _created_by_update(self, group: dict[str, Any]) -> list[str]: ...

    def _state_keys(self, group: dict[str, Any]) -> list[str]: ...

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None: ...

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Tensor | None]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None: ...

    def _compiled_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]: ...

    def _compiled_coefficients(self, group: dict[str, Any], steps: Tensor) -> list[Tensor]: ...

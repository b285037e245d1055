"""RMSprop with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.rmsprop import rmsprop

from ._core import MixedPrecisionOptimizer

__all__ = ["RMSprop"]


class RMSprop(MixedPrecisionOptimizer, torch.optim.RMSprop):
    """:class:`torch.optim.RMSprop` with float32 master weights and 16-bit gradients.

    Takes every argument of the parent, with the same defaults, plus the keyword-only
    ``grad_dtype`` and ``max_grad_norm``: see :class:`mixedopt.MixedPrecisionOptimizer`.
    """

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        keys = ["square_avg"]
        if group["momentum"] > 0:
            keys.append("momentum_buffer")
        if group["centered"]:
            keys.append("grad_avg")
        return keys

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        if len(state) != 0:
            return
        state["step"] = torch.zeros((), dtype=torch.float32)
        for key in self._state_keys(group):
            state[key] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
    ) -> None:
        rmsprop(
            params,
            grads,
            states["square_avg"],
            states.get("grad_avg", []),
            states.get("momentum_buffer", []),
            steps,
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            centered=group["centered"],
            foreach=group["foreach"],
            maximize=group["maximize"],
        )

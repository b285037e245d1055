"""SGD with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.sgd import sgd

from ._compiled import optional, scalars, sgd_kernel
from ._core import MixedPrecisionOptimizer

__all__ = ["SGD"]


class SGD(MixedPrecisionOptimizer, torch.optim.SGD):
    """:class:`torch.optim.SGD` with float32 master weights and 16-bit gradients.

    Takes every argument of the parent, with the same defaults, plus the keyword-only
    ``grad_dtype`` and ``max_grad_norm``: see :class:`mixedopt.MixedPrecisionOptimizer`.
    """

    _compiled_kernel = staticmethod(sgd_kernel)
    _parent_has_torch_fused = True
    _compiled_state_order = ("momentum_buffer",)

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        pass  # sgd() creates the momentum buffer from the first gradient

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        chosen = self._torch_implementation(group, params).functional_kwargs()
        sgd(
            params,
            grads,
            states.get("momentum_buffer", []),
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            lr=group["lr"],
            dampening=group["dampening"],
            nesterov=group["nesterov"],
            maximize=group["maximize"],
            foreach=chosen["foreach"],
            fused=chosen["fused"],
            found_inf=found_inf,
        )

    def _compiled_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]:
        lr, momentum, one_minus_dampening = scalars(
            group["lr"], group["momentum"], 1 - group["dampening"]
        )
        return [
            lr,
            momentum,
            one_minus_dampening,
            optional(group["weight_decay"]),
            group["nesterov"],
        ]

"""Adam with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam

from ._compiled import adam_kernel, adam_step_coefficients, optional, scalars
from ._core import MixedPrecisionOptimizer

__all__ = ["Adam"]


class Adam(MixedPrecisionOptimizer, torch.optim.Adam):
    """:class:`torch.optim.Adam` with float32 master weights and 16-bit gradients.

    Takes every argument of the parent, with the same defaults, plus the keyword-only
    ``grad_dtype`` and ``max_grad_norm``: see :class:`mixedopt.MixedPrecisionOptimizer`.
    """

    _compiled_kernel = staticmethod(adam_kernel)
    _parent_has_torch_fused = True
    _compiled_state_order = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        keys = ["exp_avg", "exp_avg_sq"]
        if group["amsgrad"]:
            keys.append("max_exp_avg_sq")
        return keys

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        beta1, beta2 = group["betas"]
        chosen = self._torch_implementation(group, params).functional_kwargs()
        adam(
            params,
            grads,
            states["exp_avg"],
            states["exp_avg_sq"],
            states.get("max_exp_avg_sq", []),
            steps,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=chosen["foreach"],
            fused=chosen["fused"],
            found_inf=found_inf,
            decoupled_weight_decay=group["decoupled_weight_decay"],
        )

    def _compiled_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]:
        beta1, beta2 = group["betas"]
        weight_decay = group["weight_decay"]
        decoupled = group["decoupled_weight_decay"]
        return [
            *scalars(1 - beta1, beta2, 1 - beta2, group["eps"]),
            None if decoupled else optional(weight_decay),
            scalars(1 - group["lr"] * weight_decay)[0] if decoupled and weight_decay else None,
            abs(1 - beta1) < 0.5,
        ]

    def _compiled_coefficients(self, group: dict[str, Any], steps: Tensor) -> list[Tensor]:
        beta1, beta2 = group["betas"]
        return list(adam_step_coefficients(group["lr"], beta1, beta2, steps))

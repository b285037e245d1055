"""Adamax with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adamax import adamax
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["Adamax"]


class Adamax(MixedPrecisionOptimizer, torch.optim.Adamax):
    """``torch.optim.Adamax`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Adamax``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``2e-3``).
        betas: coefficients of the running average of the gradient and of the decay of the
            infinity norm (default ``(0.9, 0.999)``).
        eps: term added to the denominator (default ``1e-8``).
        weight_decay: weight decay, L2 penalty (default ``0``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        grad_dtype: dtype of every ``.grad``, ``torch.float16`` (default) or ``torch.bfloat16``;
            anything else is a ``ValueError``. New in mixedopt, keyword-only.
        max_grad_norm: a positive float: ``step()`` clips the true gradients of all parameter
            groups together to this L2 norm; ``None`` (default): no clipping. New in mixedopt,
            keyword-only.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 2e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["exp_avg", "exp_inf"]

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
        adamax(
            params,
            grads,
            states["exp_avg"],
            states["exp_inf"],
            steps,
            foreach=self._torch_foreach(group, params),
            maximize=group["maximize"],
            eps=group["eps"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
        )

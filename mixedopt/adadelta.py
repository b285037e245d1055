"""Adadelta with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adadelta import adadelta
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["Adadelta"]


class Adadelta(MixedPrecisionOptimizer, torch.optim.Adadelta):
    """``torch.optim.Adadelta`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Adadelta``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: coefficient that scales the delta before it is applied, a float or a one-element
            tensor (default ``1.0``).
        rho: coefficient of the running averages of the squared gradient and of the squared
            delta (default ``0.9``).
        eps: term added to the denominator (default ``1e-6``).
        weight_decay: weight decay, L2 penalty (default ``0``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        grad_dtype: dtype of every ``.grad``, ``torch.float16`` (default) or ``torch.bfloat16``;
            anything else is a ``ValueError``. New in mixedopt, keyword-only.
        max_grad_norm: a positive float: ``step()`` clips the true gradients of all parameter
            groups together to this L2 norm; ``None`` (default): no clipping. New in mixedopt,
            keyword-only.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1.0,
        rho: float = 0.9,
        eps: float = 1e-6,
        weight_decay: float = 0,
        foreach: bool | None = None,
        *,
        capturable: bool = False,
        maximize: bool = False,
        differentiable: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            rho=rho,
            eps=eps,
            weight_decay=weight_decay,
            foreach=foreach,
            capturable=capturable,
            maximize=maximize,
            differentiable=differentiable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["square_avg", "acc_delta"]

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        adadelta(
            params,
            grads,
            states["square_avg"],
            states["acc_delta"],
            steps,
            foreach=self._torch_foreach(group, params),
            lr=group["lr"],
            rho=group["rho"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            maximize=group["maximize"],
        )

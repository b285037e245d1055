"""RAdam with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from torch.optim.radam import radam

from ._core import MixedPrecisionOptimizer

__all__ = ["RAdam"]


class RAdam(MixedPrecisionOptimizer, torch.optim.RAdam):
    """``torch.optim.RAdam`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.RAdam``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-3``).
        betas: coefficients of the running averages of the gradient and of its square
            (default ``(0.9, 0.999)``).
        eps: term added to the denominator (default ``1e-8``).
        weight_decay: weight decay (default ``0``).
        decoupled_weight_decay: decay the weights as AdamW does (default ``False``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
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
        lr: float | Tensor = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        decoupled_weight_decay: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            decoupled_weight_decay=decoupled_weight_decay,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["exp_avg", "exp_avg_sq"]

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
        radam(
            params,
            grads,
            states["exp_avg"],
            states["exp_avg_sq"],
            steps,
            decoupled_weight_decay=group["decoupled_weight_decay"],
            foreach=self._torch_foreach(group, params),
            maximize=group["maximize"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
        )

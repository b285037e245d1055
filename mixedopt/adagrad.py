"""Adagrad with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adagrad import adagrad
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["Adagrad"]


class Adagrad(MixedPrecisionOptimizer, torch.optim.Adagrad):
    """``torch.optim.Adagrad`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Adagrad``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-2``).
        lr_decay: learning rate decay (default ``0``).
        weight_decay: weight decay, L2 penalty (default ``0``).
        initial_accumulator_value: the initial value of the sum of squared gradients
            (default ``0``).
        eps: term added to the denominator (default ``1e-10``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        fused: ``True``: torch's fused update, on float32 gradients upcast in bounded batches;
            ``None`` (default): the default step.
        grad_dtype: dtype of every ``.grad``, ``torch.float16`` (default) or ``torch.bfloat16``;
            anything else is a ``ValueError``. New in mixedopt, keyword-only.
        max_grad_norm: a positive float: ``step()`` clips the true gradients of all parameter
            groups together to this L2 norm; ``None`` (default): no clipping. New in mixedopt,
            keyword-only.
    """

    _parent_has_torch_fused = True

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-2,
        lr_decay: float = 0,
        weight_decay: float = 0,
        initial_accumulator_value: float = 0,
        eps: float = 1e-10,
        foreach: bool | None = None,
        *,
        maximize: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            lr_decay=lr_decay,
            weight_decay=weight_decay,
            initial_accumulator_value=initial_accumulator_value,
            eps=eps,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            fused=fused,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["sum"]

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
        adagrad(
            params,
            grads,
            states["sum"],
            steps,
            fused=chosen["fused"],
            found_inf=found_inf,
            foreach=chosen["foreach"],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            lr_decay=group["lr_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
        )

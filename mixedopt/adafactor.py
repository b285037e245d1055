"""Adafactor with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim._adafactor import adafactor
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["Adafactor"]


class Adafactor(MixedPrecisionOptimizer, torch.optim.Adafactor):
    """``torch.optim.Adafactor`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Adafactor``, positional and keyword, with the same
    defaults and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``. Its state
    is factored: a matrix (or a stack of them) keeps the mean squared gradient of each row and
    of each column, a vector or a scalar one per element, so that after the weights the
    gradient is what a parameter costs most, and a 16-bit gradient halves that. Each parameter
    is updated whole (the factors are means over whole rows and columns).
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-2``).
        beta2_decay: the decay rate of the second moments' averaging coefficient
            (default ``-0.8``).
        eps: ``(eps1, eps2)``: the term added to the denominator (``None``: the smallest
            float32 number) and the lower bound of the relative step (default ``(None, 1e-3)``).
        d: the clipping threshold of the update's root mean square (default ``1.0``).
        weight_decay: weight decay (default ``0.0``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        grad_dtype: dtype of every ``.grad``, ``torch.float16`` (default) or ``torch.bfloat16``;
            anything else is a ``ValueError``. New in mixedopt, keyword-only.
        max_grad_norm: a positive float: ``step()`` clips the true gradients of all parameter
            groups together to this L2 norm; ``None`` (default): no clipping. New in mixedopt,
            keyword-only.
    """

    _updates_whole_parameters = True

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-2,
        beta2_decay: float = -0.8,
        eps: tuple[float | None, float] = (None, 1e-3),
        d: float = 1.0,
        weight_decay: float = 0.0,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            beta2_decay=beta2_decay,
            eps=eps,
            d=d,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["row_var", "col_var", "variance"]  # a parameter keeps the first two or the last

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """As the parent, in float32: row and column factors for a matrix, else one per element."""
        if len(state) != 0:
            return
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        if param.dim() > 1:
            state["row_var"] = param.new_zeros((*param.shape[:-1], 1))
            state["col_var"] = param.new_zeros((*param.shape[:-2], 1, param.shape[-1]))
        else:
            state["variance"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        eps1, eps2 = group["eps"]
        adafactor(
            params,
            grads,
            states["row_var"],
            states["col_var"],
            states["variance"],
            steps,
            foreach=self._torch_foreach(group, params),
            d=group["d"],
            lr=group["lr"],
            beta2_decay=group["beta2_decay"],
            weight_decay=group["weight_decay"],
            eps1=eps1,
            eps2=eps2,
            maximize=group["maximize"],
        )

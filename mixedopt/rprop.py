"""Rprop with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from torch.optim.rprop import rprop

from ._core import MixedPrecisionOptimizer

__all__ = ["Rprop"]


class Rprop(MixedPrecisionOptimizer, torch.optim.Rprop):
    """``torch.optim.Rprop`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Rprop``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: the initial step size of every element, a float or a one-element tensor
            (default ``1e-2``).
        etas: the factors that shrink and grow an element's step size (default ``(0.5, 1.2)``).
        step_sizes: the smallest and largest step sizes (default ``(1e-6, 50)``).
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
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
        lr: float | Tensor = 1e-2,
        etas: tuple[float, float] = (0.5, 1.2),
        step_sizes: tuple[float, float] = (1e-6, 50),
        *,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            etas=etas,
            step_sizes=step_sizes,
            capturable=capturable,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["prev", "step_size"]

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """As the parent: the previous gradient's zeros, and every step size at ``lr``."""
        if len(state) != 0:
            return
        state["step"] = torch.zeros((), dtype=torch.float32)
        state["prev"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        lr = group["lr"]
        state["step_size"] = torch.full_like(
            param, lr.item() if torch.is_tensor(lr) else lr, memory_format=torch.preserve_format
        )

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        etaminus, etaplus = group["etas"]
        step_size_min, step_size_max = group["step_sizes"]
        rprop(
            params,
            grads,
            states["prev"],
            states["step_size"],
            steps,
            foreach=self._torch_foreach(group, params),
            maximize=group["maximize"],
            step_size_min=step_size_min,
            step_size_max=step_size_max,
            etaminus=etaminus,
            etaplus=etaplus,
        )

"""ASGD with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.asgd import asgd
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["ASGD"]


class ASGD(MixedPrecisionOptimizer, torch.optim.ASGD):
    """``torch.optim.ASGD`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.ASGD``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-2``).
        lambd: decay term (default ``1e-4``).
        alpha: power of the learning rate's update (default ``0.75``).
        t0: the step at which averaging starts (default ``1e6``).
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
        lr: float | Tensor = 1e-2,
        lambd: float = 1e-4,
        alpha: float = 0.75,
        t0: float = 1e6,
        weight_decay: float = 0,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        capturable: bool = False,
        *,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            lambd=lambd,
            alpha=alpha,
            t0=t0,
            weight_decay=weight_decay,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            capturable=capturable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["ax", "mu", "eta"]

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """As the parent: the average of the weights, and 0-dim on the parameter's device.

        The step, the averaging coefficient ``mu`` and the step size ``eta``.
        """
        if len(state) != 0:
            return
        lr = group["lr"]
        device = param.device
        state["step"] = torch.zeros((), dtype=torch.float32, device=device)
        state["eta"] = torch.as_tensor(
            lr.item() if torch.is_tensor(lr) else lr, dtype=torch.float32, device=device
        ).clone()
        state["mu"] = torch.ones((), dtype=torch.float32, device=device)
        state["ax"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        asgd(
            params,
            grads,
            states["ax"],
            states["mu"],
            states["eta"],
            steps,
            foreach=self._torch_foreach(group, params),
            maximize=group["maximize"],
            lambd=group["lambd"],
            lr=group["lr"],
            t0=group["t0"],
            alpha=group["alpha"],
            weight_decay=group["weight_decay"],
        )

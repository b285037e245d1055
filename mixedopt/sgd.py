"""SGD with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from torch.optim.sgd import sgd

from ._compiled import optional, scalars, sgd_kernel
from ._core import MixedPrecisionOptimizer

__all__ = ["SGD"]


class SGD(MixedPrecisionOptimizer, torch.optim.SGD):
    """``torch.optim.SGD`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.SGD``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-3``).
        momentum: momentum factor (default ``0``).
        dampening: dampening for momentum (default ``0``).
        weight_decay: weight decay, L2 penalty (default ``0``).
        nesterov: Nesterov momentum (default ``False``).
        maximize: maximize the objective instead of minimizing it (default ``False``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        fused: ``True``: the compiled one-pass step (mixedopt's kernels, which read the 16-bit
            gradients, for large parameters; torch's fused update for small ones); ``None``
            (default): the default step.
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
        momentum: float = 0,
        dampening: float = 0,
        weight_decay: float | Tensor = 0,
        nesterov: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        differentiable: bool = False,
        fused: bool | None = None,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            differentiable=differentiable,
            fused=fused,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    _compiled_kernel = staticmethod(sgd_kernel)
    _parent_has_torch_fused = True
    _compiled_state_order = ("momentum_buffer",)

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["momentum_buffer"] if group["momentum"] != 0 else []

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        pass  # sgd() creates the momentum buffer from the first gradient

    def _created_by_update(self, group: dict[str, Any]) -> list[str]:
        return self._state_keys(group)

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

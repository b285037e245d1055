"""RMSprop with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT
from torch.optim.rmsprop import rmsprop

from ._compiled import optional, rmsprop_kernel, scalars
from ._core import MixedPrecisionOptimizer

__all__ = ["RMSprop"]


class RMSprop(MixedPrecisionOptimizer, torch.optim.RMSprop):
    """``torch.optim.RMSprop`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.RMSprop``, positional and keyword, with the same
    defaults and meaning, plus the keyword-only ``grad_dtype``, ``max_grad_norm`` and ``fused``
    (which ``torch.optim.RMSprop`` lacks).
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate, a float or a one-element tensor (default ``1e-2``).
        alpha: smoothing constant of the running average of the squared gradient
            (default ``0.99``).
        eps: term added to the denominator (default ``1e-8``).
        weight_decay: weight decay, L2 penalty (default ``0``).
        momentum: momentum factor (default ``0``).
        centered: normalize by an estimate of the gradient's variance (default ``False``).
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        fused: ``True``: mixedopt's compiled one-pass step, which reads the 16-bit gradients
            directly; ``None`` (default): the default step. New in mixedopt (torch's RMSprop
            has no fused step), keyword-only; with ``foreach=True`` a ``RuntimeError``.
        grad_dtype: dtype of every ``.grad``, ``torch.float16`` (default) or ``torch.bfloat16``;
            anything else is a ``ValueError``. New in mixedopt, keyword-only.
        max_grad_norm: a positive float: ``step()`` clips the true gradients of all parameter
            groups together to this L2 norm; ``None`` (default): no clipping. New in mixedopt,
            keyword-only.
    """

    _compiled_kernel = staticmethod(rmsprop_kernel)
    _compiled_state_order = ("square_avg", "momentum_buffer", "grad_avg")

    def __init__(
        self,
        params: ParamsT,
        lr: float | Tensor = 1e-2,
        alpha: float = 0.99,
        eps: float = 1e-8,
        weight_decay: float = 0,
        momentum: float = 0,
        centered: bool = False,
        capturable: bool = False,
        foreach: bool | None = None,
        maximize: bool = False,
        differentiable: bool = False,
        *,
        fused: bool | None = None,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        if fused and foreach:  # as torch.optim.Adam and SGD say
            raise RuntimeError("`fused` and `foreach` cannot be `True` together.")
        super().__init__(
            params,
            lr=lr,
            alpha=alpha,
            eps=eps,
            weight_decay=weight_decay,
            momentum=momentum,
            centered=centered,
            capturable=capturable,
            foreach=foreach,
            maximize=maximize,
            differentiable=differentiable,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )
        if fused is not None:  # without it, the param groups are exactly the parent's
            self.defaults["fused"] = fused
            for group in self.param_groups:
                group.setdefault("fused", fused)

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        keys = ["square_avg"]
        if group["momentum"] > 0:
            keys.append("momentum_buffer")
        if group["centered"]:
            keys.append("grad_avg")
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
        rmsprop(
            params,
            grads,
            states["square_avg"],
            states.get("grad_avg", []),
            states.get("momentum_buffer", []),
            steps,
            lr=group["lr"],
            alpha=group["alpha"],
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            centered=group["centered"],
            foreach=self._torch_foreach(group, params),
            maximize=group["maximize"],
        )

    def _compiled_hyperparameters(self, group: dict[str, Any]) -> list[Tensor | bool | None]:
        alpha = group["alpha"]
        lr, alpha, one_minus_alpha, eps, momentum = scalars(
            group["lr"], alpha, 1 - alpha, group["eps"], group["momentum"]
        )
        return [
            lr,
            alpha,
            one_minus_alpha,
            eps,
            optional(group["weight_decay"]),
            momentum,
            abs(1 - group["alpha"]) < 0.5,
        ]

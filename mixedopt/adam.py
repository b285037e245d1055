"""Adam with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim.adam import adam
from torch.optim.optimizer import ParamsT

from ._compiled import adam_kernel, adam_step_coefficients, optional, scalars
from ._core import MixedPrecisionOptimizer

__all__ = ["Adam"]


class Adam(MixedPrecisionOptimizer, torch.optim.Adam):
    """``torch.optim.Adam`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Adam``, positional and keyword, with the same defaults
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
        weight_decay: weight decay, L2 penalty (default ``0``).
        amsgrad: use the AMSGrad variant (default ``False``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        maximize: maximize the objective instead of minimizing it (default ``False``).
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        differentiable: must stay ``False``; ``True`` is refused with a ``ValueError``.
        fused: ``True``: the compiled one-pass step (mixedopt's kernels, which read the 16-bit
            gradients, for large parameters; torch's fused update for small ones); ``None``
            (default): the default step.
        decoupled_weight_decay: decay the weights as AdamW does (default ``False``).
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
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0,
        amsgrad: bool = False,
        *,
        foreach: bool | None = None,
        maximize: bool = False,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        decoupled_weight_decay: bool = False,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    _compiled_kernel = staticmethod(adam_kernel)
    _parent_has_torch_fused = True
    _foreach_fewer_temporaries = True  # the for-loop's denominator: a square root, then a division
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

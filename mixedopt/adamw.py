"""AdamW with float32 master weights and 16-bit gradients."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer
from .adam import Adam

__all__ = ["AdamW"]


class AdamW(Adam, torch.optim.AdamW):
    """``torch.optim.AdamW`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.AdamW``, positional and keyword, with the same defaults
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
        weight_decay: decoupled weight decay coefficient (default ``1e-2``).
        amsgrad: use the AMSGrad variant (default ``False``).
        maximize: maximize the objective instead of minimizing it (default ``False``).
        foreach: ``True``: torch's foreach implementation; ``False``: its for-loop; ``None``
            (default): torch's choice, and on a CPU also foreach for batches of small tensors.
        capturable: must stay ``False``; ``True`` is refused with a ``ValueError``.
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
        betas: tuple[float | Tensor, float | Tensor] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        amsgrad: bool = False,
        *,
        maximize: bool = False,
        foreach: bool | None = None,
        capturable: bool = False,
        differentiable: bool = False,
        fused: bool | None = None,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        # Past mixedopt.Adam's, which passes decoupled_weight_decay: torch.optim.AdamW sets it.
        MixedPrecisionOptimizer.__init__(
            self,
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            differentiable=differentiable,
            fused=fused,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

"""Muon with float32 master weights and 16-bit gradients."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor
from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, DEFAULT_NS_STEPS, EPS, muon
from torch.optim.optimizer import ParamsT

from ._core import MixedPrecisionOptimizer

__all__ = ["Muon"]


class Muon(MixedPrecisionOptimizer, torch.optim.Muon):
    """``torch.optim.Muon`` with float32 master weights and 16-bit gradients.

    Takes every argument of ``torch.optim.Muon``, positional and keyword, with the same defaults
    and meaning, plus the keyword-only ``grad_dtype`` and ``max_grad_norm``. Like its parent it
    takes 2-D parameters only (anything else is torch's ``ValueError``). Each matrix is updated
    whole, its momentum orthogonalised by Newton-Schulz iterations as torch does; under
    ``step_in_backward()`` a matrix is updated once its whole gradient is stored.
    The methods and attributes it adds to the parent's (``step()`` as described there,
    ``true_grad()``, ``remove_grad_storage()``, ``step_in_backward()``, ``skipped_steps``,
    ``last_grad_norm``, ``grad_dtype``, ``max_grad_norm``) are those of
    [MixedPrecisionOptimizer][mixedopt.MixedPrecisionOptimizer].

    Args:
        params: the parameters to optimize, or dicts defining parameter groups, as for the
            parent; every parameter must be float32 (anything else is a ``ValueError``).
        lr: learning rate (default ``1e-3``).
        weight_decay: weight decay (default ``0.1``).
        momentum: momentum factor (default ``0.95``).
        nesterov: use Nesterov momentum (default ``True``).
        ns_coefficients: the coefficients of the Newton-Schulz iteration
            (default ``(3.4445, -4.775, 2.0315)``).
        eps: term added to the norm the momentum is divided by (default ``1e-7``).
        ns_steps: Newton-Schulz iterations (default ``5``).
        adjust_lr_fn: how the learning rate follows the matrix's shape: ``None`` (default) or
            ``"original"``, or ``"match_rms_adamw"``.
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
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = (DEFAULT_A, DEFAULT_B, DEFAULT_C),
        eps: float = EPS,
        ns_steps: int = DEFAULT_NS_STEPS,
        adjust_lr_fn: str | None = None,
        *,
        grad_dtype: torch.dtype = torch.float16,
        max_grad_norm: float | None = None,
    ) -> None:
        super().__init__(
            params,
            lr=lr,
            weight_decay=weight_decay,
            momentum=momentum,
            nesterov=nesterov,
            ns_coefficients=ns_coefficients,
            eps=eps,
            ns_steps=ns_steps,
            adjust_lr_fn=adjust_lr_fn,
            grad_dtype=grad_dtype,
            max_grad_norm=max_grad_norm,
        )

    def _state_keys(self, group: dict[str, Any]) -> list[str]:
        return ["momentum_buffer"]

    def _init_state(self, param: Tensor, group: dict[str, Any], state: dict[str, Any]) -> None:
        """As the parent: a float32 momentum buffer, and no step counter."""
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(param, memory_format=torch.preserve_format)

    def _update(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        grads: list[Tensor],
        states: dict[str, list[Any]],
        steps: list[Tensor],
        found_inf: Tensor | None = None,
    ) -> None:
        muon(
            params,
            grads,
            states["momentum_buffer"],
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            momentum=group["momentum"],
            nesterov=group["nesterov"],
            ns_coefficients=group["ns_coefficients"],
            eps=group["eps"],
            ns_steps=group["ns_steps"],
            adjust_lr_fn=group["adjust_lr_fn"],
            has_complex=False,
        )

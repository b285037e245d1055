"""``fused=True``: each parameter's update in one compiled pass over its memory.

Each kernel below reads the 16-bit gradient, upcasts and unscales it, computes the parent's
update in float32, and writes weights and state -- or writes back what was there when ``skip`` is
set (an inf/NaN gradient), so that no host synchronisation is needed to decide. The kernels are
compiled with ``torch.compile`` (Inductor emits C++ on CPU and Triton on CUDA) with dynamic
shapes, and every number that may change between steps (learning rate, betas, momentum, scales)
is a 0-dim tensor: one compilation serves every parameter size and every step. Python booleans
(``amsgrad``, ``nesterov``, ...) are part of the compiled layout.

The default path (torch's own functional ``rmsprop()``/``adam()``/``sgd()``) is the reference
these kernels are tested against.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def _keep_if(skip: Tensor, old: Tensor, new: Tensor) -> None:
    old.copy_(torch.where(skip, old, new))


# Every kernel takes ``unscale``, the factor that turns the stored gradient into the true one
# (negated for ``maximize``). Options that only change numbers (weight decay 0 or not, maximize,
# nesterov) are tensors, so that they do not multiply the compiled variants; options that change
# which state tensors exist are Python booleans. The coefficients (1 - beta2, bias corrections,
# ...) arrive as float32 0-dim tensors computed in float64 outside the kernels, as torch.optim
# computes them in Python before its float32 kernels: the kernels do float32 elementwise work
# only, and nothing per element that could be done once.


def rmsprop_kernel(
    param: Tensor,
    grad: Tensor,
    unscale: Tensor,
    skip: Tensor,
    step: Tensor,
    square_avg: Tensor,
    momentum_buffer: Tensor | None,
    grad_avg: Tensor | None,
    lr: Tensor,
    alpha: Tensor,
    one_minus_alpha: Tensor,
    eps: Tensor,
    weight_decay: Tensor,
    momentum: Tensor,
    *,
    centered: bool,
) -> None:
    """The update of ``torch.optim.RMSprop`` (``_single_tensor_rmsprop``)."""
    g = grad.float() * unscale + weight_decay * param
    new_square_avg = square_avg * alpha + one_minus_alpha * g * g
    if centered:
        assert grad_avg is not None
        new_grad_avg = torch.lerp(grad_avg, g, one_minus_alpha)
        avg = (new_square_avg - new_grad_avg * new_grad_avg).sqrt() + eps
        _keep_if(skip, grad_avg, new_grad_avg)
    else:
        avg = new_square_avg.sqrt() + eps
    if momentum_buffer is not None:
        new_buffer = momentum_buffer * momentum + g / avg
        new_param = param - lr * new_buffer
        _keep_if(skip, momentum_buffer, new_buffer)
    else:
        new_param = param - lr * (g / avg)
    _keep_if(skip, square_avg, new_square_avg)
    _keep_if(skip, param, new_param)
    _keep_if(skip, step, step + 1)


def adam_kernel(
    param: Tensor,
    grad: Tensor,
    unscale: Tensor,
    skip: Tensor,
    step: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step_size: Tensor,
    inverse_bias_correction2_sqrt: Tensor,
    one_minus_beta1: Tensor,
    beta2: Tensor,
    one_minus_beta2: Tensor,
    eps: Tensor,
    weight_decay: Tensor,
    decay: Tensor,
) -> None:
    """The update of ``torch.optim.Adam`` and ``AdamW`` (``_single_tensor_adam``).

    ``weight_decay`` is Adam's (added to the gradient); ``decay`` is AdamW's factor on the
    weights, ``1 - lr * weight_decay`` (1 for Adam).
    """
    g = grad.float() * unscale + weight_decay * param
    new_exp_avg = torch.lerp(exp_avg, g, one_minus_beta1)
    new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    if max_exp_avg_sq is not None:  # amsgrad
        new_max = torch.maximum(max_exp_avg_sq, new_exp_avg_sq)
        denom = new_max.sqrt() * inverse_bias_correction2_sqrt + eps
        _keep_if(skip, max_exp_avg_sq, new_max)
    else:
        denom = new_exp_avg_sq.sqrt() * inverse_bias_correction2_sqrt + eps
    _keep_if(skip, param, param * decay - step_size * (new_exp_avg / denom))
    _keep_if(skip, exp_avg, new_exp_avg)
    _keep_if(skip, exp_avg_sq, new_exp_avg_sq)
    _keep_if(skip, step, step + 1)


def adam_step_coefficients(
    lr: float | Tensor, beta1: float, beta2: float, step: Tensor
) -> list[Tensor]:
    """Adam's step size and 1 / sqrt(second bias correction) for the coming step, in float64.

    The kernel multiplies by the inverse where torch divides (a division per element costs more
    than the memory traffic on a CPU): at most an ulp apart. A step counter on the CPU is read
    (free there); one on an accelerator stays there.
    """
    if step.device.type == "cpu" and not isinstance(lr, Tensor):
        next_step = step.item() + 1
        return scalars(lr / (1 - beta1**next_step), (1 - beta2**next_step) ** -0.5)
    next_step = step.double() + 1
    step_size = lr / (1 - beta1**next_step)
    return [step_size.float(), (1 - beta2**next_step).rsqrt().float()]


def sgd_kernel(
    param: Tensor,
    grad: Tensor,
    unscale: Tensor,
    skip: Tensor,
    step: None,
    momentum_buffer: Tensor | None,
    lr: Tensor,
    momentum: Tensor,
    one_minus_dampening: Tensor,
    weight_decay: Tensor,
    nesterov: Tensor,
) -> None:
    """The update of ``torch.optim.SGD``, momentum buffer present (``_single_tensor_sgd``)."""
    g = grad.float() * unscale + weight_decay * param
    if momentum_buffer is not None:
        new_buffer = momentum_buffer * momentum + one_minus_dampening * g
        g = torch.where(nesterov, g + momentum * new_buffer, new_buffer)
        _keep_if(skip, momentum_buffer, new_buffer)
    _keep_if(skip, param, param - lr * g)


def flat_alias(t: Tensor) -> Tensor:
    """A 1-D tensor on the memory of ``t`` (contiguous, 1-D) that is not a view of it.

    Compiled code guards on the shape of a view's base: views of parameters of different ranks
    would each compile again. These aliases compile once for every parameter.
    """
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


def scalars(*values: float | Tensor) -> list[Tensor]:
    """Coefficients as 0-dim float32 tensors: a new value does not recompile.

    Python numbers are rounded to float32 from float64, as torch's kernels round them.
    """
    return [torch.as_tensor(v, dtype=torch.float64).float() for v in values]


_compiled: dict[Callable[..., None], Callable[..., None]] = {}
_unavailable_reason: str | None = None


def compiled(kernel: Callable[..., None]) -> Callable[..., None]:
    """The compiled version of ``kernel`` (compiled on first call, then cached by torch)."""
    if kernel not in _compiled:
        _compiled[kernel] = torch.compile(kernel, dynamic=True, fullgraph=True)
    return _compiled[kernel]


def available() -> bool:
    """False once compiling has failed in this process."""
    return _unavailable_reason is None


def run(kernel: Callable[..., None], param: Tensor, *args: Any, **flags: bool) -> bool:
    """Run the compiled ``kernel``; False (after one warning) when no compiler is available.

    Parameters of fewer than 2 elements run the same kernel eagerly: compiled with dynamic
    shapes, sizes 0 and 1 would each be compiled again.
    """
    global _unavailable_reason
    if _unavailable_reason is not None:
        return False
    if param.numel() < 2:
        kernel(param, *args, **flags)
        return True
    try:
        compiled(kernel)(param, *args, **flags)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        # Compilation fails before anything is written: the caller falls back safely.
        _unavailable_reason = str(error).splitlines()[0]
        warnings.warn(
            "mixedopt: fused=True needs torch.compile, which failed here "
            f"({_unavailable_reason}); using the default (unfused) step from now on",
            RuntimeWarning,
            stacklevel=4,
        )
        return False
    return True

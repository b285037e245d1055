"""mixedopt's update kernels, compiled with ``torch.compile`` (``fused=True``).

Each kernel reads the 16-bit gradient, upcasts and unscales it, computes the parent's update in
float32, and writes weights and state. Dynamic shapes and tensors for every number that may
change between steps: one compilation serves every size and step. The default path (torch's
functional update) is the reference these kernels are tested against.
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ._budget import budget


def _write(destination: Tensor, new: Tensor, skip: Tensor | None) -> None:
    """``destination = new``, or unchanged where ``skip`` (a 0-dim bool tensor) is set."""
    destination.copy_(new if skip is None else torch.where(skip, destination, new))


def _lerp(start: Tensor, end: Tensor, weight: Tensor, weight_below_half: bool) -> Tensor:
    """``torch.lerp(start, end, weight)``, with its formula chosen once rather than per element.

    torch.lerp computes ``start + weight * (end - start)`` where ``|weight| < 0.5`` and
    ``end - (end - start) * (1 - weight)`` elsewhere. The weight is a group setting (1 - beta1,
    1 - alpha), so the caller knows which applies, and the compiled loop needs no test.
    """
    if weight_below_half:
        return start + weight * (end - start)
    return end - (end - start) * (1 - weight)


# Every kernel takes the parameter, its stored gradient, ``factor`` (turns the stored gradient
# into the true one, negated for ``maximize``) and its state, then per-parameter coefficients,
# then what the whole group shares. The coefficients (1 - beta2,
# bias corrections, ...) arrive as float32 0-dim tensors computed in float64 outside the kernels,
# as torch.optim computes them in Python before its float32 kernels: the kernels do float32
# elementwise work only, and nothing per element that could be done once.


def rmsprop_kernel(
    param: Tensor,
    grad: Tensor,
    factor: Tensor,
    square_avg: Tensor,
    momentum_buffer: Tensor | None,
    grad_avg: Tensor | None,
    skip: Tensor | None,
    lr: Tensor,
    alpha: Tensor,
    one_minus_alpha: Tensor,
    eps: Tensor,
    weight_decay: Tensor | None,
    momentum: Tensor,
    alpha_above_half: bool,
) -> None:
    """The update of ``torch.optim.RMSprop`` (``_single_tensor_rmsprop``)."""
    g = grad.float() * factor
    if weight_decay is not None:
        g = g + weight_decay * param
    new_square_avg = square_avg * alpha + one_minus_alpha * g * g
    if grad_avg is not None:  # centered
        new_grad_avg = _lerp(grad_avg, g, one_minus_alpha, alpha_above_half)
        avg = (new_square_avg - new_grad_avg * new_grad_avg).sqrt() + eps
        _write(grad_avg, new_grad_avg, skip)
    else:
        avg = new_square_avg.sqrt() + eps
    if momentum_buffer is not None:
        new_buffer = momentum_buffer * momentum + g / avg
        new_param = param - lr * new_buffer
        _write(momentum_buffer, new_buffer, skip)
    else:
        new_param = param - lr * (g / avg)
    _write(square_avg, new_square_avg, skip)
    _write(param, new_param, skip)


def adam_kernel(
    param: Tensor,
    grad: Tensor,
    factor: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    max_exp_avg_sq: Tensor | None,
    step_size: Tensor,
    inverse_bias_correction2_sqrt: Tensor,
    skip: Tensor | None,
    one_minus_beta1: Tensor,
    beta2: Tensor,
    one_minus_beta2: Tensor,
    eps: Tensor,
    weight_decay: Tensor | None,
    decay: Tensor | None,
    beta1_above_half: bool,
) -> None:
    """The update of ``torch.optim.Adam`` and ``AdamW`` (``_single_tensor_adam``).

    ``weight_decay`` is Adam's (added to the gradient); ``decay`` is AdamW's factor on the
    weights, ``1 - lr * weight_decay``. ``step_size`` and ``inverse_bias_correction2_sqrt`` come
    from ``adam_step_coefficients``.
    """
    g = grad.float() * factor
    if weight_decay is not None:
        g = g + weight_decay * param
    new_exp_avg = _lerp(exp_avg, g, one_minus_beta1, beta1_above_half)
    new_exp_avg_sq = exp_avg_sq * beta2 + one_minus_beta2 * g * g
    if max_exp_avg_sq is not None:  # amsgrad
        new_max = torch.maximum(max_exp_avg_sq, new_exp_avg_sq)
        denom = new_max.sqrt() * inverse_bias_correction2_sqrt + eps
        _write(max_exp_avg_sq, new_max, skip)
    else:
        denom = new_exp_avg_sq.sqrt() * inverse_bias_correction2_sqrt + eps
    decayed = param if decay is None else param * decay
    _write(param, decayed - step_size * (new_exp_avg / denom), skip)
    _write(exp_avg, new_exp_avg, skip)
    _write(exp_avg_sq, new_exp_avg_sq, skip)


def adam_step_coefficients(
    lr: float | Tensor, beta1: float, beta2: float, steps: Tensor
) -> tuple[Tensor, Tensor]:
    """Adam's step size and 1 / sqrt(second bias correction) for the coming step of each counter.

    ``steps`` is a 1-D tensor of step counters; the results are float32 tensors like it,
    computed in float64 and rounded to float32. The kernel multiplies by the inverse where torch
    divides (a division per element costs more than the memory traffic on a CPU): at most an ulp
    apart. Counters on the CPU are read (free there), and each distinct count is computed once
    in Python, as torch.optim computes it; counters on an accelerator stay there (no read: a
    read is a host synchronisation).
    """
    if isinstance(lr, Tensor):
        lr = lr.reshape(())  # torch accepts a one-element tensor of any shape
    if budget(steps.device).on_host and not isinstance(lr, Tensor):
        counts = steps.tolist()
        by_count: dict[float, tuple[float, float]] = {}
        for count in counts:
            if count not in by_count:
                n = count + 1
                by_count[count] = (lr / (1 - beta1**n), (1 - beta2**n) ** -0.5)
        values = [by_count[count] for count in counts]
        table = torch.tensor(values, dtype=torch.float64).float().reshape(-1, 2)
        return table[:, 0], table[:, 1]
    next_step = steps.double() + 1
    step_size = lr / (1 - beta1**next_step)
    return step_size.float(), (1 - beta2**next_step).rsqrt().float()


def sgd_kernel(
    param: Tensor,
    grad: Tensor,
    factor: Tensor,
    momentum_buffer: Tensor | None,
    skip: Tensor | None,
    lr: Tensor,
    momentum: Tensor,
    one_minus_dampening: Tensor,
    weight_decay: Tensor | None,
    nesterov: bool,
) -> None:
    """The update of ``torch.optim.SGD`` (``_single_tensor_sgd``)."""
    g = grad.float() * factor
    if weight_decay is not None:
        g = g + weight_decay * param
    if momentum_buffer is not None:
        new_buffer = momentum_buffer * momentum + one_minus_dampening * g
        g = g + momentum * new_buffer if nesterov else new_buffer
        _write(momentum_buffer, new_buffer, skip)
    _write(param, param - lr * g, skip)


def flat_alias(t: Tensor) -> Tensor:
    """A 1-D tensor on the memory of ``t`` (contiguous): not a view, and at storage offset 0.

    Compiled code guards on the shape of a view's base, and on whether a storage offset is 0
    (dynamic shapes specialise 0 and 1): views of parameters of different ranks, or gradients
    that start a buffer next to gradients that do not (the rows of a bucket), would each compile
    again, up to 2 ** PARAMETERS_PER_CALL variants of one call. These aliases compile once for
    every parameter. A tensor that does not start its storage gets one of its own, starting
    where it does, through DLPack (which keeps ``t``'s memory alive); on a device DLPack does
    not support, an alias at ``t``'s offset, which may compile another variant. A tensor that
    is such a tensor already (a gradient stored alone) is returned as it is, unless it requires
    grad: compiled code must not see a parameter, whose ``.grad`` is 16-bit.
    """
    if t.dim() == 1 and t.storage_offset() == 0 and t._base is None and not t.requires_grad:
        return t
    if t.storage_offset() != 0:
        try:
            return torch.from_dlpack(t.detach().view(-1))
        except (BufferError, RuntimeError, TypeError):
            pass
    alias = torch.empty(0, dtype=t.dtype, device=t.device)
    return alias.set_(t.untyped_storage(), t.storage_offset(), (t.numel(),), (1,))


def scalars(*values: float | Tensor) -> list[Tensor]:
    """Coefficients as 0-dim float32 tensors: a new value does not recompile.

    Python numbers are rounded to float32 from float64, as torch's kernels round them. A
    one-element tensor (a tensor ``lr`` of any shape, as torch accepts) becomes 0-dim.
    """
    return [torch.as_tensor(v, dtype=torch.float64).float().reshape(()) for v in values]


def optional(value: float) -> Tensor | None:
    """A coefficient that is often 0 (weight decay): ``None`` then, which skips its work."""
    return None if value == 0 else scalars(value)[0]


_compiled: dict[Callable[..., None], Callable[..., None]] = {}
_unavailable_reason: str | None = None
# Compiled kernels are called one at a time in the process. A torch.compile'd function is not
# safe to enter from several threads at once in torch 2.13: its entry keeps process-wide state
# (fullgraph's count of compiled frames, which then raises "found no compiled frames"), and
# dynamo's lookup of its compiled variants fails guards that hold under a concurrent call and
# compiles again; a compile makes ``torch.compiler.is_compiling()``, which is process-wide,
# true for every thread's torch.optim update while it lasts (docs/design.md, "Who owns what").
_calling = threading.Lock()


def compiled(kernel: Callable[..., None]) -> Callable[..., None]:
    """The compiled version of ``kernel`` (compiled on first call, then cached by torch)."""
    if kernel not in _compiled:
        # Inductor decides at compile time whether a C++ loop runs on several threads, from
        # the sizes it compiles for: a small first call would leave every later one
        # single-threaded. With dynamic_threads every loop is parallel and OpenMP decides.
        # The last elements of a loop (fewer than a vector) run as scalar code instead of a
        # second, masked vector copy of the loop: a shorter compile for at most 7 elements.
        # A graph here builds at most one C++ kernel: built on the calling thread it takes as
        # long as on Inductor's thread pool, and a compile inside backward (step_in_backward)
        # hands no work to other threads while autograd waits on it. (docs/performance.md)
        options: dict[str, str | int | bool | Callable[..., Any]] = {
            "cpp.dynamic_threads": True,
            "cpp.enable_loop_tail_vec": False,
            "compile_threads": 1,
        }
        _compiled[kernel] = torch.compile(kernel, dynamic=True, fullgraph=True, options=options)
    return _compiled[kernel]


def available() -> bool:
    """False once compiling has failed in this process."""
    return _unavailable_reason is None


# Compiled variants per kernel: a pack and a single parameter, times the layouts a process uses
# (options on or off, gradient dtypes, devices). torch.compile's default limit, 8 per function,
# is soon reached by a process with several optimizers; past this one, kernels run uncompiled.
RECOMPILE_LIMIT = 64
_over_limit: set[Callable[..., None]] = set()  # warned about


# Steps inside ``recompiles_allowed``, on every thread, and the settings it replaced.
_allowing_lock = threading.Lock()
_allowing = 0
_saved_settings: tuple[int, bool] | None = None


@contextlib.contextmanager
def recompiles_allowed() -> Iterator[None]:
    """The context ``run`` calls must be made in: dynamo's recompile limit at ``RECOMPILE_LIMIT``.

    Entered once around a step's calls, not per call. Sizes that happen to be equal when a
    kernel compiles are not taken to be equal for good (no "duck" shapes): ``run_each``'s
    parameters have unrelated sizes, which would otherwise compile again the first time they
    differ. The two settings are process-wide: the first step to enter sets them and the last
    to leave restores them, so that steps on several threads at once neither see them
    restored under them nor leave them changed. Without ``config.patch()``'s machinery, which
    costs more than the step's other Python here.
    """
    global _allowing, _saved_settings
    dynamo = torch._dynamo.config
    fx = torch.fx.experimental._config  # type: ignore[attr-defined]
    with _allowing_lock:
        if _allowing == 0:
            _saved_settings = dynamo.recompile_limit, fx.use_duck_shape
            dynamo.recompile_limit, fx.use_duck_shape = RECOMPILE_LIMIT, False
        _allowing += 1
    try:
        yield
    finally:
        with _allowing_lock:
            _allowing -= 1
            if _allowing == 0 and _saved_settings is not None:
                dynamo.recompile_limit, fx.use_duck_shape = _saved_settings
                _saved_settings = None


# Large parameters updated by one compiled call of ``run_each``. Fewer are padded with scratch
# ones, so that one compiled variant serves any number. A call costs far more than its Python
# suggests: each comes after a pass over megabytes that has emptied the caches, and its guards,
# wrappers and the step's bookkeeping run cold. Each parameter more per call lengthens the first
# compile (one more loop in the C++ kernel), which must stay under 15 s. Eight is where the
# step time levels off (docs/performance.md).
PARAMETERS_PER_CALL = 8

_each: dict[Callable[..., None], Callable[..., None]] = {}


def each_parameter(kernel: Callable[..., None]) -> Callable[..., None]:
    """``kernel`` over a list of parameters, with factors and coefficients as vectors.

    ``parameters`` holds ``(param, grad, *states)`` per parameter, ``factors`` and each of
    ``coefficients`` one value per parameter, and every parameter gets ``shared``.
    """
    if kernel not in _each:

        def update_each(
            parameters: list[tuple[Tensor | None, ...]],
            factors: Tensor,
            coefficients: list[Tensor],
            shared: tuple[Any, ...],
        ) -> None:
            for j, (param, grad, *states) in enumerate(parameters):
                kernel(param, grad, factors[j], *states, *[c[j] for c in coefficients], *shared)

        # A code object of its own per kernel: dynamo keeps compiled variants, and counts them
        # against its recompile limit, per code object.
        name = f"{kernel.__name__}_each"
        update_each.__code__ = update_each.__code__.replace(co_name=name, co_qualname=name)
        update_each.__name__ = update_each.__qualname__ = name
        _each[kernel] = update_each
    return _each[kernel]


def run_each(
    kernel: Callable[..., None],
    parameters: list[tuple[Tensor | None, ...]],
    factors: Tensor,
    coefficients: list[Tensor],
    shared: tuple[Any, ...],
) -> bool:
    """``run`` of ``each_parameter(kernel)``: ``PARAMETERS_PER_CALL`` large parameters at once."""
    return _run(each_parameter(kernel), (parameters, factors, coefficients, shared))


def run(kernel: Callable[..., None], arguments: tuple[Any, ...]) -> bool:
    """Run the compiled ``kernel``; False (after one warning) when no compiler is available.

    Called inside ``recompiles_allowed()``. A parameter of fewer than 2 elements runs eagerly:
    compiled with dynamic shapes, sizes 0 and 1 would each be compiled again. So does a call of
    a new layout once the kernel has ``RECOMPILE_LIMIT`` compiled variants (after one warning):
    the same arithmetic, in several passes.
    """
    if _unavailable_reason is None and arguments[0].numel() < 2:
        kernel(*arguments)
        return True
    return _run(kernel, arguments)


def _run(kernel: Callable[..., None], arguments: tuple[Any, ...]) -> bool:
    global _unavailable_reason
    if _unavailable_reason is not None:
        return False
    function = compiled(kernel)
    try:
        with _calling:
            function(*arguments)
    except torch._dynamo.exc.BackendCompilerFailed as error:
        # Compilation fails before anything is written: the caller falls back safely.
        _unavailable_reason = str(error).splitlines()[0]
        warnings.warn(
            "mixedopt: fused=True needs torch.compile, which failed here "
            f"({_unavailable_reason}); using the default (unfused) step from now on",
            RuntimeWarning,
            stacklevel=6,
        )
        return False
    except torch._dynamo.exc.FailOnRecompileLimitHit:
        # Raised before anything runs: nothing was written. Layouts compiled so far stay so.
        if kernel not in _over_limit:
            _over_limit.add(kernel)
            warnings.warn(
                f"mixedopt: fused=True has compiled {kernel.__name__} for {RECOMPILE_LIMIT} "
                "parameter layouts; parameters of other layouts are updated uncompiled",
                RuntimeWarning,
                stacklevel=6,
            )
        kernel(*arguments)
    return True

"""Code that always runs eagerly, whatever frame torch.compile is compiling around it.

Autograd calls the gradient storage's hooks, and the callbacks queued for the end of a
backward, from the frame that called ``backward()``. When that frame is being compiled
(``loss.backward()`` inside a ``torch.compile``'d function), dynamo would trace each of them,
once per parameter, until its recompile limit. ``run_eagerly`` marks a function's code so that
dynamo skips it and every frame it calls; a ``torch.compile``'d function called from there
still compiles. Unlike a ``torch.compiler.disable`` wrapper, the mark costs nothing per call.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from torch._C._dynamo.eval_frame import (
    _FrameAction,
    _FrameExecStrategy,
    set_code_exec_strategy,
)

Function = TypeVar("Function", bound=Callable[..., object])

_SKIP_ALL = _FrameExecStrategy(_FrameAction.SKIP, _FrameAction.SKIP)


def run_eagerly(function: Function) -> Function:
    """Have dynamo skip ``function`` and all it calls; returns ``function`` itself."""
    set_code_exec_strategy(function.__code__, _SKIP_ALL)
    return function


def compiled_autograd_is_on() -> bool:
    """Whether torch.compile traces backwards into graphs (``compiled_autograd``).

    There the storage's hooks are traced as doing nothing: autograd keeps the float32
    gradients, which ``step()`` takes as true gradients.
    """
    dynamo = sys.modules.get("torch._dynamo")  # not imported: nothing compiles
    return dynamo is not None and bool(dynamo.config.compiled_autograd)

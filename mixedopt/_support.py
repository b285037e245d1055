"""The torch mixedopt runs on: what it needs of torch, checked once, at import.

mixedopt declares ``torch>=2.13`` (the version its tests run on, docs/support.md) and uses a few
of torch's private functions, which a torch release may rename or remove. Where one is missing,
importing mixedopt fails at once with the list of what is missing, instead of a step failing in
the middle of a training run.
"""

from __future__ import annotations

import importlib

import torch

TESTED_TORCH = "2.13.0"

# Each name mixedopt needs that torch's documentation does not promise, with where it is used.
NEEDED: dict[str, str] = {
    "torch.Tensor.grad_dtype": "the 16-bit .grad (public since torch 2.10)",
    "torch._C._current_graph_task_id": "which backward a gradient belongs to",
    "torch._C._len_torch_dispatch_stack": "whether a dispatch mode is tracing",
    "torch._C._will_engine_execute_node": "whether a backward accumulates a gradient",
    "torch.Tensor._use_count": "whether a gradient is held elsewhere",
    "torch.autograd.graph.Node._sequence_nr": "the order a forward made autograd's nodes in",
    "torch.autograd.graph.Node._input_metadata": "the dtype a cast's node makes",
    "torch._C._storage_Use_Count": "whether a gradient's memory is shared",
    "torch.optim.optimizer._device_dtype_check_for_fused": "fused=True's checks, as torch's",
    "torch._dynamo.exc.FailOnRecompileLimitHit": "fused=True's fallback when compiling fails",
    "torch._foreach_copy_": "copying gradients in one launch",
}


def _resolve(name: str) -> bool:
    """Whether ``name``, a module's dotted path and then attributes, can be found."""
    parts = name.split(".")
    for split in range(len(parts), 0, -1):  # the longest prefix that is a module
        try:
            obj: object = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            if not hasattr(obj, attribute):
                return False
            obj = getattr(obj, attribute)
        return True
    return False


def missing(needed: dict[str, str] = NEEDED) -> list[str]:
    """The names of ``needed`` this torch lacks, with what each is for."""
    return [f"{name} ({why})" for name, why in needed.items() if not _resolve(name)]


def check_torch() -> None:
    """Raise ``ImportError`` where this torch lacks what mixedopt needs.

    Raises:
        ImportError: naming each missing function, the torch installed and the one tested.
    """
    lacking = missing()
    if lacking:
        raise ImportError(
            f"mixedopt needs torch >= 2.13 (its tests run on torch {TESTED_TORCH}); this torch, "
            f"{torch.__version__}, lacks: {'; '.join(lacking)}. Install the tested release: "
            f"pip install torch=={TESTED_TORCH}"
        )

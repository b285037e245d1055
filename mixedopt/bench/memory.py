"""The peak extra memory of one optimizer step, for ``python -m mixedopt.bench``.

Also the bytes a variant holds (``persistent_bytes``), and the child processes and ``/proc``
readings that ``mixedopt.bench.in_backward`` measures its memory with.

Peak memory on CPU
    Each variant is set up again in a fresh child process (``python -m mixedopt.bench`` run
    with a hidden flag: its ``main`` calls ``child_memory``), so that nothing another variant
    allocated is mixed into its numbers. The child builds the
    parameters, gradients and optimizer, runs the first step and the warm-up steps, then writes
    ``5`` to ``/proc/self/clear_refs``, which resets the kernel's resident-set high-water mark
    (VmHWM) to the current resident size (Linux 4.0 and later). It reads VmRSS (the baseline),
    runs one step and reads VmHWM: peak extra = VmHWM - baseline, every page the step touched
    beyond what was already resident, however briefly. The child checks that the reset took
    (VmHWM no longer above VmRSS). Where it did not, the result is still exact when the step set
    a new high (VmHWM rose during the step: the peak was reached in the step), and otherwise only
    an upper bound is known, ``VmHWM - baseline``, which the table prints as ``<= x``.

    The child runs with glibc's malloc told to hand every block of 128 KiB or more straight to
    ``mmap`` and back to the kernel on ``free`` (``MALLOC_MMAP_THRESHOLD_`` fixed, which also stops
    glibc from raising that threshold after the first large ``free``, and
    ``MALLOC_TRIM_THRESHOLD_``). Without this, memory freed by the warm-up steps can stay
    resident in the heap: the measured step would reuse it without raising the high-water mark,
    and its temporaries would go unseen. With it, resident memory follows the tensors alive at
    each moment. The timing runs in the parent process, with the default allocator settings.

Peak memory on CUDA
    ``torch.cuda.reset_peak_memory_stats()`` before the step, then
    ``max_memory_allocated() - memory_allocated()`` (the value before the step): the allocator's
    own count of live bytes, exact and per process, so it is measured in the parent.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

import mixedopt

from .setup import build, teardown

# Child memory runs: blocks from this size on go to mmap and back to the kernel when freed.
_MMAP_THRESHOLD = 128 * 1024
# Slack when checking that VmHWM was reset to VmRSS: reading /proc itself may touch a page or two.
_RESET_SLACK = 256 * 1024
CHILD_FLAG = "--_memory-child"


def persistent_bytes(params: list[nn.Parameter], opt: torch.optim.Optimizer) -> int:
    """Bytes held by the weights, their gradients and every tensor of the optimizer state."""
    total = 0
    for p in params:
        total += p.nbytes
        if p.grad is not None:
            total += p.grad.nbytes
        for value in opt.state.get(p, {}).values():
            if torch.is_tensor(value):
                total += value.nbytes
    return total


def proc_status() -> dict[str, int]:
    """VmRSS and VmHWM of this process, in bytes."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                found[key] = int(value.split()[0]) * 1024
    return found


def reset_hwm() -> None:
    """Reset this process's VmHWM to its VmRSS, where the kernel can (Linux 4.0 and later)."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
    except OSError:
        pass  # the caller sees that VmHWM stayed above VmRSS


def malloc_trim() -> None:
    """Hand the C library's free heap memory back to the system (glibc only)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc


def child_memory(spec: dict[str, Any]) -> dict[str, Any]:
    """In a fresh process: the peak extra resident memory of one step (see the module doc)."""
    device = torch.device("cpu")
    params, opt = build(spec["optimizer"], spec["variant"], spec["numel"], spec["params"], device)
    for _ in range(1 + max(1, spec["warmup"])):
        opt.step()
    gc.collect()
    malloc_trim()
    reset_hwm()
    before = proc_status()
    opt.step()
    after = proc_status()
    baseline = before["VmRSS"]
    reset = before["VmHWM"] <= baseline + _RESET_SLACK
    rose = after["VmHWM"] > before["VmHWM"]
    result: dict[str, Any] = {
        "baseline_rss": baseline,
        "hwm_before": before["VmHWM"],
        "hwm_after": after["VmHWM"],
        "reset": reset,
        "live_bytes": persistent_bytes(params, opt),
    }
    if reset or rose:
        result["peak_extra_bytes"] = max(0, after["VmHWM"] - baseline)
        result["method"] = "VmHWM after clear_refs reset" if reset else "VmHWM rose during step"
    else:
        result["peak_extra_upper_bound"] = after["VmHWM"] - baseline
        result["method"] = "VmHWM not resettable: upper bound"
    teardown(params, opt)
    return result


def run_memory_child(module: str, arguments: Sequence[str]) -> dict[str, Any]:
    """``python -m module *arguments`` in a new interpreter, with malloc set up as above.

    The JSON object the child prints last, or ``{"error": ...}``.
    """
    env = dict(os.environ)
    env["MALLOC_MMAP_THRESHOLD_"] = str(_MMAP_THRESHOLD)
    env["MALLOC_TRIM_THRESHOLD_"] = str(_MMAP_THRESHOLD)
    package_root = str(Path(mixedopt.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", module, *arguments]
    try:
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired:
        return {"error": "the memory child timed out"}
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": f"the memory child failed: {tail}"}
    return json.loads(lines[-1])


def measure_memory_in_child(spec: dict[str, Any], threads: int) -> dict[str, Any]:
    """Run :func:`child_memory` in a new interpreter; its result, or ``{"error": ...}``."""
    arguments = ["--threads", str(threads), "--device", "cpu", CHILD_FLAG, json.dumps(spec)]
    return run_memory_child("mixedopt.bench", arguments)


def cuda_peak(opt: torch.optim.Optimizer, device: torch.device) -> int:
    """Peak extra bytes the CUDA caching allocator handed out during one step."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    opt.step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before

"""How much is packed on each device: its ``Budget``.

A budget is the capacity of a buffer, the largest tensor packed, the step's batch size, and
whether the device is the host (``on_host``), which the few places where a CPU and an
accelerator differ ask, so that tests run the accelerator's branches on the CPU
(``CPU_BUDGET``). Immutable values, read at call time: owned by nobody. See docs/design.md,
"Packing and budgets".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

# Elements of float32 in one buffer: 1 Mi elements = 4 MiB on a CPU (it stays in cache while it is
# read back), 4 Mi = 16 MiB on an accelerator (fewer launches).
CPU_CAPACITY = 1 << 20
ACCELERATOR_CAPACITY = 1 << 22
# The largest tensor worked on together with others on a CPU (backward's buckets, fused=True's
# packs, the default step's foreach batches): above it, a tensor's bytes cost more than the few
# dispatches it takes alone.
CPU_SMALL = 1 << 15
# Elements of one batch of the default step on a CPU (a larger parameter is cut into pieces of
# it): the functional update passes over a batch several times and allocates temporaries of its
# size (Adam: two), which are smaller and come back from the allocator warm (docs/performance.md).
CPU_PIECE = 1 << 19
# On an accelerator: the largest gradient backward stores in a bucket with others (a larger one
# is stored alone, in four launches), so that every bucket stored during backward holds three
# gradients at least.
ACCELERATOR_BUCKET_SMALL = 1 << 20
# On an accelerator: the largest parameter fused=True packs (a compiled call costs more than a
# copy of that size).
ACCELERATOR_FUSED_SMALL = 1 << 20
# On an accelerator: elements of one batch of the default step (256 MiB of float32). A batch
# costs a few launches beyond torch's own update whatever its size; at 64 Mi elements they are
# a few percent of the memory time of its update.
ACCELERATOR_BATCH = 1 << 26
# What mixedopt holds between steps on the host beyond the weights, the gradients (their 16-bit
# buffers) and the optimizer's state: at most HELD_BETWEEN_STEPS bytes, plus HELD_PER_TENSOR per
# parameter tensor (tests/test_live_memory.py audits it; docs/design.md, "Packing and budgets").
# The buffers a step or a backward works in go back to the allocator when it ends. What stays:
# the float16 scale table (255 scales and the 254 bounds of float32's binades, 2 KiB per
# device) and a few scalars; per tensor, its storage scale and bound (8 B), and its place in the
# index tables a training loop repeats (8 B in each: a bucket's row counts, the positions a step
# gathers at), with room for a few tables more than a loop of backward() and step() keeps.
HELD_BETWEEN_STEPS = 4 << 10
HELD_PER_TENSOR = 64
# The CPU's budget when set (tests give it an accelerator's, ``accelerator_budget``, to run the
# accelerator path on the CPU); None: the CPU's own, from the limits above.
CPU_BUDGET: Budget | None = None


@dataclass(frozen=True)
class Budget:
    """How much is packed on a device, and what the device is.

    ``capacity``: elements in one bucket, slice or pack (the memory a buffer costs), and the
    largest buffer a ``Workspace`` keeps between steps.
    ``bucket_small``: the largest gradient backward stores in a bucket with others.
    ``fused_small``: the largest parameter ``fused=True`` packs with others (weights, gradient
    and state copied in and out around one compiled call).
    ``piece``: elements in one batch of the default step, a larger parameter cut into 1-D
    pieces of this size.
    ``on_host``: the device is the host (a CPU): a value is read there without synchronising
    with a device, and fresh memory costs the system's page faults at the first write.
    Elsewhere every operation is a kernel launch, and a read a synchronisation.
    """

    capacity: int
    bucket_small: int
    fused_small: int
    piece: int
    on_host: bool


def budget(device: torch.device) -> Budget:
    """The packing budget of ``device`` (read at call time, so that tests can change it)."""
    if device.type == "cpu":
        return CPU_BUDGET or _cpu_budget(CPU_CAPACITY, CPU_SMALL, CPU_PIECE)
    return accelerator_budget(
        ACCELERATOR_CAPACITY, ACCELERATOR_BUCKET_SMALL, ACCELERATOR_FUSED_SMALL, ACCELERATOR_BATCH
    )


# Kept per value of the limits: backward asks for a budget once per gradient stored alone.
@functools.cache
def _cpu_budget(capacity: int, small: int, piece: int) -> Budget:
    small = min(small, capacity)
    return Budget(capacity, small, small, min(piece, capacity), on_host=True)


@functools.cache
def accelerator_budget(capacity: int, bucket_small: int, fused_small: int, batch: int) -> Budget:
    """The budget of an accelerator with these limits (tests give it to the CPU too)."""
    return Budget(
        capacity, min(bucket_small, capacity), min(fused_small, capacity), batch, on_host=False
    )

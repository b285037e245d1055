"""The memory bound of one step(), measured as the process's peak resident memory (Linux)."""

from __future__ import annotations

import os

import pytest
from helpers import peak_in_child

from mixedopt.bench import in_backward

pytestmark = pytest.mark.skipif(
    not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs"
)

MiB = 1 << 20
NUMEL = 2_000_000
COUNT = 16

# One child process per measurement (helpers.peak_in_child): the peak is reset just before the
# step.
MEASURE = """
library, name, fused, numel, count, batch = sys.argv[1:7]
if int(batch):  # an accelerator's budget, batches of ``batch`` elements in the default step
    mixedopt._budget.CPU_BUDGET = mixedopt._budget.accelerator_budget(
        1 << 22, 1 << 20, 1 << 20, int(batch)
    )
kwargs = {"momentum": 0.9} if name == "SGD" else {}
params = [torch.nn.Parameter(torch.randn(int(numel))) for _ in range(int(count))]
if library == "torch":
    opt = getattr(torch.optim, name)(params, foreach=True, **kwargs)
    grad_dtype = torch.float32
else:
    opt = getattr(mixedopt, name)(params, fused=fused == "fused", **kwargs)
    grad_dtype = torch.float16
for p in params:
    p.grad = torch.randn(int(numel)).to(grad_dtype)
for _ in range(3):  # state exists, fused kernels are compiled
    opt.step()
reset_peak()
before = status("VmRSS")
opt.step()
print(json.dumps({"extra": status("VmHWM") - before}))
"""


def peak_extra_bytes(library, name, fused=False, batch=0):
    return peak_in_child(
        MEASURE, library, name, "fused" if fused else "default", NUMEL, COUNT, batch
    )


BOUND = 64 * MiB + 1.25 * NUMEL * 4  # issue's bound: 64 MiB + 1.25 x the largest fp32 parameter


@pytest.mark.parametrize("name", ["RMSprop", "Adam", "SGD"])
def test_default_step_extra_memory_is_bounded(name):
    assert peak_extra_bytes("mixedopt", name) <= BOUND


def test_fused_step_extra_memory_is_bounded():
    assert peak_extra_bytes("mixedopt", "Adam", fused=True) <= BOUND


BATCH = 1 << 23  # four of the 2M-element parameters, in float32 32 MiB


@pytest.mark.parametrize("name", ["RMSprop", "Adam", "SGD"])
def test_default_step_extra_memory_on_an_accelerator_is_at_most_two_batches(name):
    """The batch's float32 gradients, and the temporaries of torch's update of the batch (Adam,
    RMSprop: one batch more); 64 Mi elements a batch on an accelerator: 512 MiB."""
    assert peak_extra_bytes("mixedopt", name, batch=BATCH) <= 2 * 4 * BATCH


def test_the_measurement_sees_a_full_size_temporary():
    """torch.optim.RMSprop(foreach=True) allocates +4 B/param during step(): 128 MB here."""
    assert peak_extra_bytes("torch", "RMSprop") > 3 * NUMEL * COUNT


# step_in_backward(): 64 x Linear(1024, 1024), 67M parameters, Adam, batch 1, float32 forward
# (mixedopt.bench.in_backward's memory table): weights 4 B + state 8 B + what the iteration holds.
IN_BACKWARD = f"mixedopt.Adam, {in_backward.IN_BACKWARD}"
STEPPED = f"mixedopt.Adam, {in_backward.STEPPED}"


def bytes_per_param(mode, forward="float32"):
    (found,) = in_backward.memory_table(modes=[mode], forwards=[forward])[mode].values()
    assert "error" not in found, found["error"]
    assert found["params"] >= 64_000_000
    return found["bytes_per_param"]


def test_updating_backward_peak_is_at_most_12_5_bytes_per_parameter():
    assert bytes_per_param(IN_BACKWARD) <= 12.5


def test_the_measurement_sees_the_float16_gradients_of_backward_then_step():
    assert bytes_per_param(STEPPED) >= 13.5


def test_updating_backward_under_mixedopt_autocast_peak_is_at_most_12_5_bytes_per_parameter():
    """torch.autocast's float16 weight copies (2 B/param) are not kept for backward."""
    assert bytes_per_param(IN_BACKWARD, "mixedopt.autocast") <= 12.5


def test_the_measurement_sees_the_weight_copies_torch_autocast_keeps():
    assert bytes_per_param(IN_BACKWARD, "torch.autocast") >= 13.5

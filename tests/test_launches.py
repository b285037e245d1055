"""What a GPU pays: kernel launches and host synchronisations of the accelerator path.

Counted on meta parameters (``mixedopt.bench.launches``), which take every branch mixedopt takes
on an accelerator, against torch.optim with ``foreach=True`` (what torch picks on CUDA), for 4
and 16 layers of small and large ``Linear`` weights: per parameter, the launches added with each
parameter; the constant, what is left at 16 layers, backward and step together.
"""

from __future__ import annotations

import pytest
import torch
from helpers import sgd_with_a_pass_more

import mixedopt
from mixedopt.bench.launches import MODELS, OPTIMIZERS, LaunchCounter, launch_counts, launch_table

LARGE = ["Linear(2048, 2048)", "Linear(4096, 4096)"]


@pytest.fixture(scope="module")
def rows():
    return {(row.model, row.optimizer): row for row in launch_table()}


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", LARGE)
def test_backward_launches_at_most_four_kernels_per_large_gradient_beyond_torch(
    rows, model, optimizer
):
    assert rows[model, optimizer].backward_per_param <= 4


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_small_parameters_cost_no_launch_of_their_own(rows, optimizer):
    row = rows["Linear(64, 64)", optimizer]
    assert row.backward_per_param == 0
    assert row.step_per_param == 0


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_default_step_launches_at_most_one_kernel_per_4mi_parameter(rows, optimizer):
    """16 x 4Mi elements fit one batch of the default step."""
    assert rows["Linear(2048, 2048)", optimizer].step_per_param <= 1


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_the_default_step_launches_at_most_four_kernels_per_16mi_parameter(rows, optimizer):
    assert rows["Linear(4096, 4096)", optimizer].step_per_param <= 4


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_an_iteration_launches_at_most_32_kernels_beyond_the_per_parameter_ones(
    rows, model, optimizer
):
    assert rows[model, optimizer].constant <= 32


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("model", MODELS)
def test_the_default_step_synchronises_with_the_host_once(rows, model, optimizer):
    """To read whether a gradient is inf or NaN (the step is skipped then); torch.optim never."""
    row = rows[model, optimizer]
    assert row.mixedopt.syncs == 1
    assert row.torch.syncs == 0


def test_the_count_sees_a_launch_per_parameter():
    """The measurement itself: an operation per parameter after step() shows as one more."""

    plain = launch_counts(lambda p: mixedopt.SGD(p, lr=0.1, foreach=True), 4, 64, True)
    extra = launch_counts(sgd_with_a_pass_more, 4, 64, True)
    assert extra.step - plain.step == plain.params


def test_the_count_leaves_out_views_allocations_and_host_work():
    x = torch.empty(4, 4, device="meta")
    cpu = torch.ones(3)
    with LaunchCounter() as counter:
        x.t().unsqueeze(0)  # views
        x.view(-1)
        torch.empty(3, device="meta")
        x.detach()
        cpu.add_(1)  # the host's own work
        bool(x.sum() > 0)  # one launch each for sum and gt, and a host synchronisation
    assert counter.launches == 2
    assert counter.syncs == 1

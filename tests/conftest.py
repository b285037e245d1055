import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# CI runs every property 200 times; locally a quicker profile. Deadlines are off: a first call
# into torch can take far longer than the following ones.
settings.register_profile(
    "ci",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("dev", max_examples=30, deadline=None)
# tests/test_mutations.py: the same examples every run, a failure reported as found.
settings.register_profile(
    "mutations",
    max_examples=100,
    deadline=None,
    derandomize=True,
    database=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

# Markers, by test module: ``pytest -m "not slow"`` is the quick loop of a change (a minute);
# the README's test command runs everything. Hypothesis properties are slow wherever they are.
MODULE_MARKERS = {
    "test_bench": ("slow",),  # benchmarks in child processes
    "test_compiled_backward": ("slow",),  # torch.compile
    "test_cuda": ("cuda",),  # skipped without a CUDA device
    "test_demo": ("slow",),  # the side-by-side demo
    "test_distributed": ("slow", "distributed"),  # process groups
    "test_fused": ("slow",),  # torch.compile
    "test_launches": ("slow",),  # counts whole training iterations of several models
    "test_memory": ("slow",),  # peaks measured in child processes
    "test_mutations": ("slow",),  # the parity tests, run on broken copies of the library
    "test_notebooks": ("slow", "notebooks"),  # executes the notebooks
    "test_optim_db": ("slow",),  # PyTorch's own optimizer tests
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        module = item.module.__name__ if item.module is not None else ""
        for name in MODULE_MARKERS.get(module.rpartition(".")[2], ()):
            item.add_marker(name)
        if getattr(item.obj, "is_hypothesis_test", False):
            item.add_marker("slow")

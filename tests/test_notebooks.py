"""Every notebook in notebooks/ runs top to bottom in smoke mode, in a fresh kernel.

Each notebook is read into memory and executed there (the committed file, with the outputs of a
full run, is left as it is) with ``MIXEDOPT_SMOKE=1`` in the kernel's environment and
``notebooks/`` as its working directory. A cell that raises fails the test. And each committed
notebook has the cells ``notebooks/build.py`` writes from its ``cells_*.py`` module.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(path.name for path in NOTEBOOKS_DIR.glob("*.ipynb"))

# Seconds a single cell may take; a whole notebook takes well under two minutes in smoke mode.
CELL_TIMEOUT = 600

# What running the notebooks needs beyond torch: the 'notebooks' extra of pyproject.toml.
REQUIRED = ("nbformat", "nbclient", "ipykernel", "matplotlib", "sklearn")

# Printed by a cell appended to the in-memory copy: which Python the kernel runs.
PREFIX_MARKER = "kernel sys.prefix: "


def _require(module: str):
    return pytest.importorskip(
        module,
        reason=(
            f"running the notebooks needs {module!r}, which is not installed; install the "
            "notebooks extra: pip install -e '.[notebooks]'"
        ),
    )


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_smoke_mode(name: str) -> None:
    modules = {module: _require(module) for module in REQUIRED}
    nbformat, nbclient = modules["nbformat"], modules["nbclient"]

    path = NOTEBOOKS_DIR / name
    committed = path.read_bytes()
    notebook = nbformat.reads(committed.decode("utf-8"), as_version=4)
    check = f"import sys\n\nprint({PREFIX_MARKER!r} + sys.prefix)"
    notebook.cells.append(nbformat.v4.new_code_cell(check))

    # "python3" is the kernel of this interpreter's own ipykernel (jupyter_client starts it with
    # sys.executable); the appended cell checks that.
    client = nbclient.NotebookClient(
        notebook,
        kernel_name="python3",
        timeout=CELL_TIMEOUT,
        allow_errors=False,
        record_timing=False,
        resources={"metadata": {"path": str(NOTEBOOKS_DIR)}},
    )
    env = dict(os.environ, MIXEDOPT_SMOKE="1", PYDEVD_DISABLE_FILE_VALIDATION="1")
    client.execute(env=env)  # raises CellExecutionError when a cell raises

    errors = [
        f"cell {index}: {output.get('ename')}: {output.get('evalue')}"
        for index, cell in enumerate(notebook.cells)
        for output in cell.get("outputs", [])
        if output.get("output_type") == "error"
    ]
    assert not errors, f"{name} raised in " + "; ".join(errors)
    printed = "".join(output.get("text", "") for output in notebook.cells[-1].outputs)
    assert printed.strip() == PREFIX_MARKER + sys.prefix, (
        f"{name} ran in a kernel of another Python: {printed.strip()!r}, expected {sys.prefix!r}"
    )
    assert path.read_bytes() == committed, f"running {name} changed the file on disk"


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_committed_notebook_has_the_cells_it_is_built_from(name: str) -> None:
    # notebooks/build.py writes each notebook from its cells_*.py module: a cell edited in one
    # place and not the other would show readers code the tests do not run.
    nbformat = _require("nbformat")
    spec = importlib.util.spec_from_file_location("notebooks_build", NOTEBOOKS_DIR / "build.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    committed = nbformat.read(NOTEBOOKS_DIR / name, as_version=4)
    built = build.build(name)
    assert [(c.cell_type, c.source) for c in committed.cells] == [
        (c.cell_type, c.source) for c in built.cells
    ]

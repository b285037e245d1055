"""Write the example notebooks of ``notebooks/`` from the cell sources beside this file.

The notebooks are generated so that their code can be reviewed as plain Python. Each notebook's
cells are a list of ``(kind, source)`` pairs in a module of their own, next to this file::

    cells_01_quickstart.py                   QUICKSTART -> 01_quickstart.ipynb
    cells_02_memory_and_speed.py             MEMORY     -> 02_memory_and_speed.ipynb
    cells_03_numerics_and_convergence.py     NUMERICS   -> 03_numerics_and_convergence.ipynb

and ``cells_common.py`` holds the lines they share (smoke mode, the clock, the seed, the figure
settings, the last cell), written into each notebook: a notebook cannot import another's cells.

Usage, from the repository root::

    python notebooks/build.py                # write the .ipynb files, without outputs
    python notebooks/build.py --execute      # write them, run them in full mode, save outputs
    python notebooks/build.py --smoke        # run them in smoke mode; write nothing

``--execute`` runs every notebook top to bottom in a fresh kernel of this interpreter with
``MIXEDOPT_SMOKE`` unset (full mode), saves them with their outputs, and the notebooks write the
exported figures into ``docs/``. Without it the files are written without outputs. ``--only
NAME`` restricts any of these to one notebook.
"""

from __future__ import annotations

import argparse
import os
import sys
import textwrap
import time
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # run as a script it is there already; imported, it may not be
    sys.path.insert(0, str(HERE))

from cells_01_quickstart import QUICKSTART
from cells_02_memory_and_speed import MEMORY
from cells_03_numerics_and_convergence import NUMERICS

KERNELSPEC = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}


def _notebook(prefix: str, cells: list[tuple[str, str]]) -> nbformat.NotebookNode:
    """A notebook from ``(kind, source)`` pairs, with stable cell ids for readable diffs."""
    built = []
    for index, (kind, source) in enumerate(cells):
        text = textwrap.dedent(source).strip("\n")
        cell_id = f"{prefix}-{index:02d}"
        if kind == "md":
            built.append(new_markdown_cell(text, id=cell_id))
        else:
            built.append(new_code_cell(text, id=cell_id))
    notebook = new_notebook(cells=built)
    notebook.metadata["kernelspec"] = dict(KERNELSPEC)
    notebook.metadata["language_info"] = {"name": "python"}
    return notebook


NOTEBOOKS = {
    "01_quickstart.ipynb": ("qs", QUICKSTART),
    "02_memory_and_speed.ipynb": ("mem", MEMORY),
    "03_numerics_and_convergence.ipynb": ("num", NUMERICS),
}


def build(name: str) -> nbformat.NotebookNode:
    """The notebook ``name``, without outputs."""
    prefix, cells = NOTEBOOKS[name]
    return _notebook(prefix, cells)


def execute(notebook: nbformat.NotebookNode, smoke: bool, timeout: int = 1200) -> float:
    """Run ``notebook`` in place in a fresh kernel of this interpreter; return the seconds."""
    from nbclient import NotebookClient

    env = dict(os.environ)
    env.pop("MIXEDOPT_SMOKE", None)
    if smoke:
        env["MIXEDOPT_SMOKE"] = "1"
    env.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")  # quiets a debugger warning
    client = NotebookClient(
        notebook,
        timeout=timeout,
        kernel_name="python3",
        record_timing=False,
        resources={"metadata": {"path": str(HERE)}},
    )
    started = time.perf_counter()
    client.execute(env=env)
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> int:
    """Command line: write, and optionally execute, the notebooks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--execute", action="store_true", help="run in full mode, save outputs")
    mode.add_argument("--smoke", action="store_true", help="run in smoke mode, save nothing")
    parser.add_argument("--only", choices=list(NOTEBOOKS), action="append", help="one notebook")
    args = parser.parse_args(argv)
    for name in args.only or list(NOTEBOOKS):
        notebook, path = build(name), HERE / name
        if args.smoke:
            print(f"{name}: smoke run {execute(notebook, smoke=True):.0f} s", flush=True)
            continue
        if args.execute:
            seconds = execute(notebook, smoke=False)
            print(f"{name}: full run {seconds:.0f} s", flush=True)
        nbformat.write(notebook, path)
        print(f"wrote {path} ({path.stat().st_size / 1024:.0f} KiB)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

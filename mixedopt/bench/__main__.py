"""``python -m mixedopt.bench``: the step benchmark, :func:`mixedopt.bench.steps.main`."""

from mixedopt.bench.steps import main

if __name__ == "__main__":
    raise SystemExit(main())

"""Runs the Python examples of README.md and docs/*.md (Sybil): every ```python block, in order.

The blocks of one file share a namespace and run top to bottom, as a reader would run them. A
block that cannot run here (it needs a GPU, or a framework that is not a test dependency) follows
a ``<!-- skip: next "why" -->`` comment and a visible line saying it is not run by the tests;
tests/test_docs.py checks that both are there, and that Sybil finds every block.
"""

from sybil import Sybil
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

DOC_EXAMPLES = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    patterns=["README.md", "docs/*.md"],
)
pytest_collect_file = DOC_EXAMPLES.pytest()

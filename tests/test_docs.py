"""The documentation: the README, the site's pages and their examples, the docstrings, .ci/run.

Every ```python block of README.md and docs/*.md runs here, through Sybil, the blocks of one file
in order and in one namespace, as a reader would run them; a block that cannot run here (it needs
a GPU, or a framework that is not a test dependency) follows a ``<!-- skip: next "why" -->``
comment and a visible line saying it is not run by the tests. Around them, what makes them
trustworthy: every block is found, and a block not run is marked so both for Sybil and for the
reader; the README keeps its shape; CI runs the README's test command; every public class,
function, method and property has a docstring whose ``Args:`` section documents exactly its
arguments, and the examples in those docstrings run; the API page covers every public name; the
command lines it lists have the flags their parsers have. ``mkdocs build --strict``, in the test
command, checks the site's links and anchors.
"""

from __future__ import annotations

import inspect
import re
import runpy
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from sybil import Document, Example, Sybil
from sybil.evaluators.skip import Skipper
from sybil.parsers.markdown import PythonCodeBlockParser, SkipParser

import mixedopt

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
DOCUMENTS = [README, *sorted(DOCS.glob("*.md"))]

# ------------------------------------------------------------------ the README

README_SECTIONS = [
    "Install",
    "The one-line swap",
    "What it saves",
    "What it costs",
    "Mind `p.grad`",
    "Two commands",
    "Documentation",
]


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_readme_is_at_most_200_lines():
    assert len(readme().splitlines()) <= 200


def test_readme_sections_come_in_order():
    headings = [line[3:] for line in readme().splitlines() if line.startswith("## ")]
    assert headings == README_SECTIONS


def test_readme_shows_the_swap_before_line_40():
    lines = readme().splitlines()
    first_python = lines.index("```python") + 1
    assert first_python < 40
    assert "mixedopt." in "\n".join(lines[first_python:40])


def test_readme_names_no_commit():
    assert re.findall(r"\b[0-9a-f]{7,40}\b", readme()) == []


def test_readme_links_point_to_files_of_the_repository():
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)\s]*)?\)", readme())
    local = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert local, "the README links to the site's pages"
    assert [t for t in local if not (ROOT / t).exists()] == []
    pages = {p.name for p in DOCS.glob("*.md")} - {"index.md", "changelog.md"}
    linked = {Path(t).name for t in local if t.startswith("docs/")}
    assert pages - linked == set(), "every page of the site is linked from the README"


def test_readme_says_how_to_preview_the_site():
    assert "mkdocs serve" in readme()


def readme_test_command() -> str:
    commands = [
        block for block in re.findall(r"```bash\n(.*?)\n```", readme(), re.S) if "pytest" in block
    ]
    assert len(commands) == 1, commands
    return commands[0]


def test_ci_runs_exactly_the_readme_test_command():
    command = readme_test_command()
    lines = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    code = [line for line in lines if line.strip() and not line.startswith("#")]
    assert code == ["set -euo pipefail", 'cd "$(dirname "$0")/.."', command]


def test_the_test_command_builds_the_site_strictly_with_the_docs_extra():
    command = readme_test_command()
    extras = re.search(r"pip install -e '\.\[([\w,]+)\]'", command)
    assert extras is not None and "docs" in extras[1].split(",")
    assert "&& mkdocs build --strict &&" in command
    development = (DOCS / "development.md").read_text(encoding="utf-8")
    assert f"```bash\n{command}\n```" in development


# ------------------------------------------------------------------ the examples

# A block that is not run: the Sybil directive, then a visible line that says so, then the block.
SKIP_DIRECTIVE = re.compile(r'^<!-- skip: next "[^"]+" -->$')
VISIBLE_NOTE = re.compile(r"^\*Not run by the tests\b")
FENCE = re.compile(r"^(\s*)```(.*)$")
NOT_RUN_LANGUAGES = {"py", "python3", "pycon", "ipython", "pytb"}  # would escape the tests


def python_blocks(path: Path) -> list[tuple[int, bool]]:
    """Each ```python block of ``path``: its line number and whether it is marked not run.

    Raises AssertionError where a block is marked for one audience only (the directive without
    the visible note, or the note without the directive), or where Python hides in a fence
    Sybil does not run.
    """
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[tuple[int, bool]] = []
    in_fence = False
    for number, line in enumerate(lines, start=1):
        match = FENCE.match(line)
        if match is None:
            continue
        if in_fence:
            in_fence = False
            continue
        in_fence = True
        info = match[2].strip()
        assert info.split(" ")[0] not in NOT_RUN_LANGUAGES, f"{path.name}:{number}: ```{info}"
        if info != "python":
            assert not info.startswith("python"), f"{path.name}:{number}: ```{info}"
            continue
        assert match[1] == "", f"{path.name}:{number}: an indented block Sybil would not find"
        above = [text for text in lines[max(0, number - 7) : number - 1] if text.strip()]
        directive = any(SKIP_DIRECTIVE.match(text) for text in above[-4:])
        note = any(VISIBLE_NOTE.match(text) for text in above[-3:])
        assert directive == note, (
            f"{path.name}:{number}: a block not run needs both the skip directive and a visible "
            "line starting '*Not run by the tests'"
        )
        blocks.append((number, directive))
    assert not in_fence, f"{path.name}: a fence is not closed"
    return blocks


# Sybil's own pytest collector is not used: tests/conftest.py gives every collected item its
# module's markers, and Sybil's items have no module. Each example is a parameter of one test.
DOC_EXAMPLES = Sybil(
    parsers=[PythonCodeBlockParser(), SkipParser()],
    path=str(ROOT),
    patterns=["README.md", "docs/*.md"],
)
_PARSED: dict[Path, Document] = {}


def parsed(path: Path) -> Document:
    """The Sybil document of ``path``, parsed once: its examples share its namespace."""
    if path not in _PARSED:
        _PARSED[path] = DOC_EXAMPLES.parse(path)
    return _PARSED[path]


def doc_examples() -> Iterator[Any]:
    for path in DOCUMENTS:
        for example in parsed(path).examples():
            kind = "skip" if isinstance(example.region.evaluator, Skipper) else "example"
            yield pytest.param(example, id=f"{path.name}:{example.line}:{kind}")


@pytest.mark.parametrize("example", list(doc_examples()))
def test_doc_example(example: Example):
    """Run one block (or read one skip directive) of README.md or docs/*.md, in file order."""
    example.evaluate()


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: p.name)
def test_sybil_finds_every_python_block(path):
    blocks = python_blocks(path)
    assert DOC_EXAMPLES.should_parse(path)
    examples = list(parsed(path).examples())
    code = [e.line for e in examples if not isinstance(e.region.evaluator, Skipper)]
    assert code == [number for number, _ in blocks]
    skips = [e.line for e in examples if isinstance(e.region.evaluator, Skipper)]
    assert len(skips) == sum(not_run for _, not_run in blocks), "one skip directive per block"


def test_most_blocks_run():
    blocks = [block for path in DOCUMENTS for block in python_blocks(path)]
    not_run = sum(skipped for _, skipped in blocks)
    assert any(not skipped for _, skipped in python_blocks(README))
    assert len(blocks) >= 15 and not_run <= 2, (len(blocks), not_run)


# ------------------------------------------------------------------ the docstrings

PUBLIC: dict[str, Any] = {name: getattr(mixedopt, name) for name in mixedopt.__all__}


def defined_in_mixedopt(owner: type) -> bool:
    return owner.__module__.split(".")[0] == "mixedopt"


def public_members(cls: type) -> Iterator[tuple[str, Any]]:
    """The public methods and properties ``cls`` has from mixedopt's code (not torch's)."""
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = next(klass for klass in cls.__mro__ if name in vars(klass))
        member = vars(owner)[name]
        if isinstance(member, staticmethod | classmethod):
            member = member.__func__
        if defined_in_mixedopt(owner) and (
            inspect.isfunction(member) or isinstance(member, property)
        ):
            yield name, member


def public_objects() -> Iterator[tuple[str, Any]]:
    for name, obj in PUBLIC.items():
        yield name, obj
        if inspect.isclass(obj):
            for member_name, member in public_members(obj):
                yield f"{name}.{member_name}", member


def documented_arguments(docstring: str) -> list[str] | None:
    """The names in the ``Args:`` section of a Google-style docstring; None without one."""
    lines = inspect.cleandoc(docstring).splitlines()
    if "Args:" not in [line.strip() for line in lines]:
        return None
    start = [line.strip() for line in lines].index("Args:") + 1
    header_indent = len(lines[start - 1]) - len(lines[start - 1].lstrip())
    names: list[str] = []
    entry_indent = None
    for line in lines[start:]:
        if not line.strip():
            continue
        indent = len(line) - len(line.lstrip())
        if indent <= header_indent:
            break  # the next section
        if entry_indent is None:
            entry_indent = indent
        if indent == entry_indent:
            entry = re.match(r"(\*{0,2}\w+)(?: \([^)]*\))?: \S", line.strip())
            assert entry is not None, f"not an argument entry: {line.strip()!r}"
            names.append(entry[1])
    return names


def argument_names(parameters: Any, starred: bool = True) -> list[str]:
    names = []
    for p in parameters:
        if p.kind is p.VAR_POSITIONAL:
            names += [f"*{p.name}"] if starred else []
        elif p.kind is p.VAR_KEYWORD:
            names += [f"**{p.name}"] if starred else []
        else:
            names.append(p.name)
    return names


def expected_arguments(obj: Any) -> list[str]:
    """The arguments a docstring must document: those of its signature (``self`` aside); a
    class's, its constructor's (an optimizer's are its parent's and mixedopt's own,
    ``tests/test_signatures.py``)."""
    if isinstance(obj, property):
        return []
    parameters = list(inspect.signature(obj).parameters.values())
    return argument_names(p for p in parameters if p.name != "self")


def docstring_problems(name: str, obj: Any) -> list[str]:
    """What is wrong with the docstring of ``obj``: missing, or arguments not as documented."""
    docstring = obj.__doc__  # not inspect.getdoc, which would take a parent's
    if not docstring or not docstring.strip():
        return [f"{name}: no docstring"]
    expected = expected_arguments(obj)
    documented = documented_arguments(docstring)
    if documented is None:
        return [f"{name}: no Args section for {expected}"] if expected else []
    problems = [f"{name}: {arg} not documented" for arg in expected if arg not in documented]
    problems += [
        f"{name}: {arg} documented, not an argument" for arg in documented if arg not in expected
    ]
    problems += [
        f"{name}: {arg} documented twice" for arg in set(documented) if documented.count(arg) > 1
    ]
    return problems


def test_every_public_name_has_a_docstring_documenting_its_arguments():
    objects = dict(public_objects())
    some = ["Adam", "MixedPrecisionOptimizer.step", "MixedPrecisionOptimizer.skipped_steps"]
    some += ["RMSprop.true_grad", "autocast"]
    assert set(some) <= set(objects)
    problems = [
        problem for name, obj in objects.items() for problem in docstring_problems(name, obj)
    ]
    assert problems == []


def test_an_optimizer_documents_its_torch_parents_arguments():
    rmsprop = set(expected_arguments(mixedopt.RMSprop))
    assert {"params", "lr", "alpha", "centered", "fused", "grad_dtype", "max_grad_norm"} <= rmsprop
    adamw = expected_arguments(mixedopt.AdamW)
    assert {"betas", "amsgrad", "fused", "grad_dtype", "max_grad_norm"} <= set(adamw)
    assert "decoupled_weight_decay" not in adamw  # torch.optim.AdamW's own arguments, not Adam's
    mixin = ["params", "*args", "grad_dtype", "max_grad_norm", "**kwargs"]
    assert expected_arguments(mixedopt.MixedPrecisionOptimizer) == mixin


def _clip(values: torch.Tensor, limit: float, *rest: Any, norm: float = 2.0) -> None:
    """Clip ``values``.

    Args:
        values: the values.
        *rest: more values.
        norm: which norm.
        scale: no such argument.
    """


def test_the_docstring_check_finds_what_is_wrong():
    assert docstring_problems("_clip", _clip) == [
        "_clip: limit not documented",
        "_clip: scale documented, not an argument",
    ]
    assert docstring_problems("f", lambda x: x) == ["f: no docstring"]
    assert docstring_problems("prop", property(lambda self: 0)) == ["prop: no docstring"]

    def undocumented(x: int) -> int:
        """Return ``x``."""
        return x

    assert docstring_problems("undocumented", undocumented) == [
        "undocumented: no Args section for ['x']"
    ]


def docstring_examples() -> Iterator[Any]:
    for name, obj in public_objects():
        code_blocks = re.findall(
            r"^[ \t]*```python\n(.*?)^[ \t]*```", obj.__doc__ or "", re.M | re.S
        )
        for number, code in enumerate(code_blocks, start=1):
            yield pytest.param(textwrap.dedent(code), id=f"{name}-{number}")


DOCSTRING_EXAMPLES = list(docstring_examples())


def test_docstrings_have_examples():
    assert len(DOCSTRING_EXAMPLES) >= 2


@pytest.mark.parametrize("code", DOCSTRING_EXAMPLES)
def test_docstring_example_runs(code):
    exec(compile(code, "<docstring example>", "exec"), {"__name__": "docstring_example"})


# ------------------------------------------------------------------ the API page

API_PAGE = DOCS / "api.md"


def api_directives() -> dict[str, list[str] | None]:
    """Each ``::: name`` of the API page and the members it lists (None: members not listed)."""
    directives: dict[str, list[str] | None] = {}
    current = None
    for line in API_PAGE.read_text(encoding="utf-8").splitlines():
        if line.startswith("::: "):
            current = line[4:].strip()
            directives[current] = None
        elif current is not None and line.strip() == "members:":
            directives[current] = []
        elif current is not None and line.startswith("        - "):
            members = directives[current]
            assert members is not None
            members.append(line.strip()[2:])
        elif not line.startswith(" "):
            current = None if line.strip() else current
    return directives


def test_the_api_page_documents_every_public_name_and_member():
    directives = api_directives()
    assert set(directives) == {f"mixedopt.{name}" for name in mixedopt.__all__}
    for path, listed in directives.items():
        obj = PUBLIC[path.rpartition(".")[2]]
        if not inspect.isclass(obj):
            continue
        own = {name for name, member in public_members(obj)}
        shared = {name for name, member in public_members(mixedopt.MixedPrecisionOptimizer)}
        if listed is None:  # the four optimizers: their members are the mixin's, shown there
            assert own <= shared, path
        else:
            assert sorted(listed) == sorted(own), path


# ------------------------------------------------------------------ the command lines


# The demo's command line is on the API page; the benchmark's, on the contributors' page: each
# in the page's "## Command lines" section.
COMMAND_PAGES = [API_PAGE, DOCS / "benchmarks.md"]


def command_lines_section(page: Path) -> str:
    text = page.read_text(encoding="utf-8")
    section = text.split("\n## Command lines\n", 1)[1]
    return section.split("\n## ", 1)[0]


def documented_flags() -> dict[str, set[str]]:
    flags: dict[str, set[str]] = {}
    for page in COMMAND_PAGES:
        text = command_lines_section(page)
        for span in re.findall(r"`(python -m [\w.]+[^`]*)`", text, re.S):
            command = span.split()[2]
            assert command not in flags, f"{command} documented twice"
            flags[command] = set(re.findall(r"--[a-z][a-z-]*", span))
    return flags


COMMANDS = ["mixedopt", "mixedopt.bench", "mixedopt.bench.small", "mixedopt.bench.launches"]
COMMANDS += ["mixedopt.bench.in_backward", "mixedopt.bench.threads", "mixedopt.bench.bytes"]


def help_of(module: str, monkeypatch: pytest.MonkeyPatch, capsys: Any) -> str:
    monkeypatch.setattr(sys, "argv", [module, "--help"])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module is imported already
        with pytest.raises(SystemExit):
            runpy.run_module(module, run_name="__main__")
    return capsys.readouterr().out


@pytest.mark.parametrize("module", COMMANDS)
def test_the_docs_list_each_commands_flags(module, monkeypatch, capsys):
    flags = set(re.findall(r"(?<![\w-])--[a-z][a-z-]*", help_of(module, monkeypatch, capsys)))
    assert documented_flags()[module] == flags - {"--help"}


def test_the_commands_are_those_documented():
    assert sorted(documented_flags()) == sorted(COMMANDS)

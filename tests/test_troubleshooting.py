"""docs/troubleshooting.md quotes every error and warning message of the library.

The messages are read from the source of mixedopt/*.py with ``ast``: the message of each
``raise X(...)``, of each ``warnings.warn(...)`` and the ``reason=`` of each
``torch.compiler.disable(...)`` (which torch.compile prints with ``fullgraph=True``). A message
is rarely a plain string: the parts of an f-string, a concatenation, a %-format or a
``.format()`` that the source does not spell out become wildcards, and what it does spell out is
followed: a name bound to a string in the function or the module, a parameter of the function
(each call site's argument gives one message: ``_refuse(why)`` is six messages), and a function
of the package that builds the exception (``raise grad_scaler_error(self)``). Each message then
becomes a regular expression of its literal parts, whitespace normalized, where a wildcard
matches the page's ``<what goes here>`` placeholder or a value written out; the page (whitespace
normalized too) must match every one. The other way, each message a ```text block of the page
quotes must be one of them: an entry cannot outlive its message.

Not collected: mixedopt/bench/ and mixedopt/__main__.py (see ``NOT_LIBRARY``), exceptions raised
without a message (``raise NotImplementedError`` of the abstract hooks, a bare re-raise) and
``assert`` statements, which state internal invariants (one that fails is a bug to report).
"""

from __future__ import annotations

import ast
import builtins
import itertools
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "mixedopt"
PAGE = ROOT / "docs" / "troubleshooting.md"

# Files of mixedopt/*.py whose messages are not the library's (mixedopt/bench/ is not globbed).
NOT_LIBRARY = {
    "__main__.py": "the demo's command line: argparse errors that name the option and its range",
}
# Messages that cannot be read from the source, as "file:line", each with why it is left out.
# Empty: every message of the library is read.
UNREADABLE_ALLOWED: dict[str, str] = {}

# A wildcard matches the page's "<what goes here>" placeholder, or a value written out.
WILDCARD = r"(?:<[^<>]+>|\S+)"
HOLE = "\x00"  # a wildcard while a message is being normalized

Parts = tuple[str | None, ...]  # literal text, None for a wildcard
Alternative = tuple[Parts, int | None]  # the parts, and the call site that gave them, if any
FunctionNode = ast.FunctionDef | ast.AsyncFunctionDef


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@dataclass(frozen=True)
class Message:
    """One message of the library: where it is raised, and its parts."""

    where: str
    parts: Parts

    def text(self) -> str:
        """The message as the page would write it, a wildcard as ``<...>``."""
        return normalize("".join("<...>" if part is None else part for part in self.parts))

    def pattern(self) -> re.Pattern[str]:
        joined = normalize("".join(HOLE if part is None else part for part in self.parts))
        return re.compile(WILDCARD.join(re.escape(piece) for piece in joined.split(HOLE)))


class CannotRead(Exception):
    pass


class Source:
    """One module's syntax tree, with what reading its messages looks up."""

    def __init__(self, path: Path, text: str) -> None:
        self.where = path.relative_to(ROOT).as_posix() if path.is_absolute() else str(path)
        self.tree = ast.parse(text)
        self.parent = {
            child: node for node in ast.walk(self.tree) for child in ast.iter_child_nodes(node)
        }
        self.constants: dict[str, ast.expr] = {}
        for node in self.tree.body:
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    if isinstance(target, ast.Name):
                        self.constants[target.id] = node.value
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                if node.value is not None:
                    self.constants[node.target.id] = node.value

    def enclosing(self, node: ast.AST) -> FunctionNode | None:
        while node in self.parent:
            node = self.parent[node]
            if isinstance(node, FunctionNode):
                return node
        return None

    def is_method(self, function: FunctionNode) -> bool:
        return isinstance(self.parent.get(function), ast.ClassDef)

    def call_sites(self, function: FunctionNode) -> list[ast.Call]:
        def named(func: ast.expr) -> bool:
            if isinstance(func, ast.Attribute):
                return func.attr == function.name
            return isinstance(func, ast.Name) and func.id == function.name

        return [n for n in ast.walk(self.tree) if isinstance(n, ast.Call) and named(n.func)]


def argument_for(source: Source, function: FunctionNode, call: ast.Call, name: str) -> ast.expr:
    """The expression ``call`` passes for the parameter ``name`` of ``function``, or raises."""
    positional = [a.arg for a in [*function.args.posonlyargs, *function.args.args]]
    if isinstance(call.func, ast.Attribute) and source.is_method(function) and positional:
        positional = positional[1:]  # self.method(...): the first parameter is bound
    for keyword in call.keywords:
        if keyword.arg == name:
            return keyword.value
    if name in positional and positional.index(name) < len(call.args):
        argument = call.args[positional.index(name)]
        if not isinstance(argument, ast.Starred):
            return argument
    raise LookupError(name)


def combine(left: list[Alternative], right: list[Alternative]) -> list[Alternative]:
    return [
        (a + b, line_b or line_a) for (a, line_a), (b, line_b) in itertools.product(left, right)
    ]


def with_holes(parts: Parts, fields: str) -> Parts:
    """``parts`` with the format fields (a regular expression) of its literal text as wildcards."""
    out: list[str | None] = []
    for part in parts:
        if part is None:
            out.append(None)
            continue
        for index, piece in enumerate(re.split(fields, part)):
            if index:
                out.append(None)
            out.append(piece)
    return tuple(out)


PERCENT_FIELD = r"%(?:\([^)]*\))?[-#0 +]*(?:\d+|\*)?(?:\.\d+)?[a-zA-Z]"
BRACE_FIELD = r"\{[^{}]*\}"
WILD: list[Alternative] = [((None,), None)]


class Reader:
    """Reads the messages of a set of modules; a builder function may be in any of them."""

    def __init__(self, sources: list[Source]) -> None:
        self.sources = sources
        self.builders = {
            node.name: (source, node)
            for source in sources
            for node in source.tree.body
            if isinstance(node, ast.FunctionDef)
        }
        self.unreadable: list[str] = []

    def string(self, source: Source, node: ast.expr, depth: int = 0) -> list[Alternative] | None:
        """The texts ``node`` may have, or None where the source does not spell it out."""
        if depth > 8:
            return None
        if isinstance(node, ast.Constant):
            if isinstance(node.value, str | int | float) and not isinstance(node.value, bool):
                return [((str(node.value),), None)]
            return None
        if isinstance(node, ast.JoinedStr):
            alternatives: list[Alternative] = [((), None)]
            for value in node.values:
                if isinstance(value, ast.Constant):
                    piece: list[Alternative] | None = [((str(value.value),), None)]
                elif isinstance(value, ast.FormattedValue):
                    plain = value.conversion == -1 and value.format_spec is None
                    piece = self.string(source, value.value, depth + 1) if plain else None
                else:
                    piece = None
                alternatives = combine(alternatives, piece or WILD)
            return alternatives
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
            left = self.string(source, node.left, depth + 1)
            right = self.string(source, node.right, depth + 1)
            if left is None and right is None:
                return None
            return combine(left or WILD, right or WILD)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod):
            template = self.string(source, node.left, depth + 1)
            if template is None:
                return None
            return [(with_holes(parts, PERCENT_FIELD), line) for parts, line in template]
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "format"
        ):
            template = self.string(source, node.func.value, depth + 1)
            if template is None:
                return None
            return [(with_holes(parts, BRACE_FIELD), line) for parts, line in template]
        if isinstance(node, ast.Name):
            return self.name(source, node, depth)
        return None

    def name(self, source: Source, node: ast.Name, depth: int) -> list[Alternative] | None:
        function = source.enclosing(node)
        if function is not None:
            arguments = function.args
            parameters = [
                a.arg for a in [*arguments.posonlyargs, *arguments.args, *arguments.kwonlyargs]
            ]
            if node.id in parameters:  # one message per call site that passes a text
                alternatives: list[Alternative] = []
                for call in source.call_sites(function):
                    try:
                        argument = argument_for(source, function, call, node.id)
                    except LookupError:
                        continue
                    read = self.string(source, argument, depth + 1)
                    if read is None:
                        return None
                    alternatives += [(parts, line or call.lineno) for parts, line in read]
                return alternatives or None
            stored = [
                n
                for n in ast.walk(function)
                if isinstance(n, ast.Name) and n.id == node.id and isinstance(n.ctx, ast.Store)
            ]
            if stored:
                values = [
                    n.value
                    for n in ast.walk(function)
                    if isinstance(n, ast.Assign)
                    and any(isinstance(t, ast.Name) and t.id == node.id for t in n.targets)
                ]
                if len(values) != len(stored):  # also bound by a loop, a with, ...
                    return None
                alternatives = []
                for value in values:
                    read = self.string(source, value, depth + 1)
                    if read is None:
                        return None
                    alternatives += read
                return alternatives
        if node.id in source.constants:
            return self.string(source, source.constants[node.id], depth + 1)
        return None

    def message_of(self, source: Source, call: ast.Call, kind: str) -> list[Alternative]:
        """The messages of an exception built by ``call`` (its first argument), or none."""
        func = call.func
        if isinstance(func, ast.Name) and func.id in self.builders:
            builder_source, builder = self.builders[func.id]
            found: list[Alternative] = []
            for node in ast.walk(builder):
                if isinstance(node, ast.Return) and node.value is not None:
                    value = node.value
                    if isinstance(value, ast.Call):
                        found += self.message_of(builder_source, value, kind)
                    else:
                        found += self.argument(builder_source, value, kind)
            return found
        if not call.args:
            return []  # an exception without a message
        return self.argument(source, call.args[0], kind)

    def argument(self, source: Source, node: ast.expr, kind: str) -> list[Alternative]:
        read = self.string(source, node, 0)
        if read is None:
            place = f"{source.where}:{node.lineno}"
            if place not in UNREADABLE_ALLOWED:
                self.unreadable.append(f"cannot read the message of {kind} at {place}")
            return []
        return read

    def messages(self) -> list[Message]:
        found: list[Message] = []
        for source in self.sources:
            for node in ast.walk(source.tree):
                for alternatives, line in self.messages_at(source, node):
                    for parts, site in alternatives:
                        found.append(Message(f"{source.where}:{site or line}", parts))
        return sorted(found, key=lambda m: (m.where.split(":")[0], int(m.where.split(":")[1])))

    def messages_at(self, source: Source, node: ast.AST) -> list[tuple[list[Alternative], int]]:
        if isinstance(node, ast.Raise) and node.exc is not None:
            exc = node.exc
            if isinstance(exc, ast.Call):
                return [(self.message_of(source, exc, "raise"), node.lineno)]
            if isinstance(exc, ast.Name) and isinstance(getattr(builtins, exc.id, None), type):
                return []  # ``raise NotImplementedError``: no message
            place = f"{source.where}:{node.lineno}"
            if place not in UNREADABLE_ALLOWED:
                self.unreadable.append(f"cannot read the message of raise at {place}")
            return []
        if not isinstance(node, ast.Call):
            return []
        function = ast.unparse(node.func)
        if function in ("warnings.warn", "warn"):
            message = node.args[0] if node.args else None
            for keyword in node.keywords:
                if keyword.arg == "message":
                    message = keyword.value
            if message is None:
                return []
            if isinstance(message, ast.Call) and isinstance(message.func, ast.Name):
                return [(self.message_of(source, message, "warnings.warn"), node.lineno)]
            return [(self.argument(source, message, "warnings.warn"), node.lineno)]
        if function.endswith("disable"):  # torch.compiler.disable(reason=...)
            reasons = [k.value for k in node.keywords if k.arg == "reason"]
            return [(self.argument(source, r, "disable(reason=)"), node.lineno) for r in reasons]
        return []


def library_sources() -> list[Source]:
    paths = sorted(p for p in PACKAGE.glob("*.py") if p.name not in NOT_LIBRARY)
    return [Source(p, p.read_text(encoding="utf-8")) for p in paths]


def collect() -> tuple[list[Message], list[str]]:
    """Every message of the library, and the places whose message cannot be read."""
    reader = Reader(library_sources())
    return reader.messages(), reader.unreadable


def missing(messages: list[Message], page: str) -> list[Message]:
    text = normalize(page)
    return [m for m in messages if m.pattern().search(text) is None]


def page() -> str:
    return PAGE.read_text(encoding="utf-8")


def read_snippet(code: str) -> tuple[list[Message], list[str]]:
    reader = Reader([Source(Path("snippet.py"), code)])
    return reader.messages(), reader.unreadable


# ------------------------------------------------------------------ the library and the page


def test_the_page_quotes_every_message_of_the_library():
    messages, _ = collect()
    absent = missing(messages, page())
    assert absent == [], "not on docs/troubleshooting.md:\n" + "\n".join(
        f"{m.where}: {m.text()}" for m in absent
    )


def test_every_message_of_the_library_can_be_read_from_its_source():
    _, unreadable = collect()
    assert unreadable == []


def test_the_collector_finds_the_messages_of_each_kind_of_source():
    messages, _ = collect()
    by_file: dict[str, list[str]] = {}
    for m in messages:
        by_file.setdefault(m.where.split(":")[0], []).append(m.text())
    known = {
        "mixedopt/rmsprop.py": ["`fused` and `foreach` cannot be `True` together."],  # a string
        "mixedopt/_autocast.py": ["mixedopt.autocast: a weight was changed in place"],
        "mixedopt/_core.py": [
            "Invalid max_grad_norm value: <...>; use a positive number",  # an f-string
            "a gradient is inf or NaN; the step was skipped",  # warnings.warn
            "GradScaler stepped mixedopt.<...> after a step_in_backward()",  # built by a function
            "use fused=True for a compiled step",  # torch.compiler.disable(reason=...)
        ],
        "mixedopt/_compiled.py": ["fused=True has compiled <...> for 64 parameter layouts"],
        "mixedopt/_in_backward.py": [  # one raise in a function, its argument at each call
            "mixedopt.<...>.step_in_backward(): already on",
            "mixedopt.<...>.step_in_backward(): max_grad_norm clips",
            "mixedopt.<...>.step_in_backward(): remove_grad_storage() was called",
            "mixedopt.<...>.step_in_backward(): FSDP2 (fully_shard) owns",
            "mixedopt.<...>.step_in_backward(): DistributedDataParallel owns",
            "mixedopt.<...>.step_in_backward(): <...> parameter(s) are also held",
        ],
        "mixedopt/_reference_step.py": ["does not support sparse gradients"],
        "mixedopt/_storage.py": ["<...> parameter(s) are reduced by torch.nn.parallel"],
    }
    not_found = [
        (path, fragment)
        for path, fragments in known.items()
        for fragment in fragments
        if not any(fragment in text for text in by_file.get(path, []))
    ]
    assert not_found == []
    assert len(messages) >= sum(map(len, known.values()))


def test_a_page_missing_a_message_fails_the_check():
    messages, _ = collect()
    text = normalize(page())
    still_found = []
    for message in messages:
        match = message.pattern().search(text)
        assert match is not None, message.text()
        without = text[: match.start()] + text[match.end() :]
        if message not in missing(messages, without):
            still_found.append(message.text())
    assert still_found == [], "matched twice on the page, or too loosely"


def test_every_message_block_of_the_page_is_a_message_of_the_library():
    messages, _ = collect()
    blocks = re.findall(r"^```text\n(.*?)^```$", page(), re.S | re.M)
    assert blocks, "the page quotes the messages in ```text blocks"
    quoted = [chunk for block in blocks for chunk in re.split(r"\n\s*\n", block) if chunk.strip()]
    stale = [
        chunk for chunk in quoted if not any(m.pattern().search(normalize(chunk)) for m in messages)
    ]
    assert stale == [], "quoted on the page, raised nowhere in the library"


# ------------------------------------------------------------------ the collector itself


def test_a_message_the_collector_cannot_read_fails_naming_its_place():
    code = "def f(error):\n    raise RuntimeError(error.args[0])\n"
    messages, unreadable = read_snippet(code)
    assert messages == []
    assert unreadable == ["cannot read the message of raise at snippet.py:2"]


def test_formatted_concatenated_and_percent_parts_become_wildcards():
    code = (
        "import warnings\n"
        "LIMIT = 8\n"
        "def f(x):\n"
        "    raise ValueError(f'got {x!r}, at most {LIMIT}' + ' (' + str(x) + ')')\n"
        "def g(x):\n"
        "    warnings.warn('%s of %d' % (x, 2))\n"
        "    raise TypeError('{} is {name}'.format(x, name=x))\n"
    )
    messages, unreadable = read_snippet(code)
    assert unreadable == []
    assert [m.text() for m in messages] == [
        "got <...>, at most 8 (<...>)",
        "<...> of <...>",
        "<...> is <...>",
    ]


def test_a_parameter_gives_one_message_per_call_site_and_a_builder_its_exception():
    code = (
        "class C:\n"
        "    def _refuse(self, why):\n"
        "        raise RuntimeError(f'{type(self).__name__}: {why}')\n"
        "    def check(self, n):\n"
        "        self._refuse('first')\n"
        "        self._refuse(why=f'{n} more')\n"
        "def error(name):\n"
        "    return KeyError('no ' + name)\n"
        "def use():\n"
        "    raise error('x')\n"
    )
    messages, unreadable = read_snippet(code)
    assert unreadable == []
    assert [(m.where, m.text()) for m in messages] == [
        ("snippet.py:5", "<...>: first"),
        ("snippet.py:6", "<...>: <...> more"),
        ("snippet.py:10", "no x"),
    ]


@pytest.mark.parametrize(
    "quoted,found",
    [
        ("mixedopt.<Optimizer> got a parameter of dtype <dtype>; rest", True),
        ("mixedopt.Adam got a parameter of dtype torch.float16;\n   rest", True),
        ("mixedopt.Adam got a parameter of dtype; rest", False),
        ("mixedopt.Adam got a parameter of dtype torch.float16 rest", False),
    ],
)
def test_a_wildcard_matches_a_placeholder_or_a_value_across_lines(quoted, found):
    message = Message("x.py:1", ("mixedopt.", None, " got a parameter of dtype ", None, "; rest"))
    assert (missing([message], quoted) == []) is found

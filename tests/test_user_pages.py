"""The user's pages: short, free of internals, and honest on their first screen.

Every page of the site is written for users except the contributors' pages (design, development,
benchmarks and their history), which may name the package's private modules and functions.
"""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
CONTRIBUTOR_PAGES = {"design.md", "development.md", "benchmarks.md"}
USER_PAGES = sorted(p for p in DOCS.glob("*.md") if p.name not in CONTRIBUTOR_PAGES)

# An identifier that starts with one underscore and is not part of a longer name: a private
# module, function or attribute (mixedopt's or torch's). Dunders (__init__) start with two.
PRIVATE_NAME = re.compile(r"(?<![A-Za-z0-9_])_[A-Za-z][A-Za-z0-9_]*")
TEST_FILE = re.compile(r"\btests/|\btest_\w+\.py\b")
WHERE_IT_SAVES_NOTHING = ["DistributedDataParallel", "FSDP2", "ZeroRedundancyOptimizer"]
WHERE_IT_SAVES_NOTHING += ["compiled autograd"]


def private_names(text: str) -> list[str]:
    return PRIVATE_NAME.findall(text)


def first_screen(path: Path) -> str:
    """What a reader sees before scrolling: the text before the second heading."""
    text = path.read_text(encoding="utf-8")
    return re.split(r"^## ", text, maxsplit=1, flags=re.M)[0]


def test_the_user_pages_are_those_of_the_site():
    names = {p.name for p in USER_PAGES}
    assert {"index.md", "should-i-use-it.md", "troubleshooting.md", "support.md"} <= names
    assert not names & CONTRIBUTOR_PAGES


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_a_user_page_is_at_most_300_lines(page):
    assert len(page.read_text(encoding="utf-8").splitlines()) <= 300


@pytest.mark.parametrize("page", [*USER_PAGES, ROOT / "README.md"], ids=lambda p: p.name)
def test_a_user_page_names_no_private_name(page):
    assert private_names(page.read_text(encoding="utf-8")) == []


@pytest.mark.parametrize("page", USER_PAGES, ids=lambda p: p.name)
def test_a_user_page_names_no_test_file(page):
    assert TEST_FILE.findall(page.read_text(encoding="utf-8")) == []


def test_the_private_name_check_finds_them():
    text = "see `mixedopt._in_backward.UPDATE_BATCH`, `_foreach_copy_` and torch._dynamo"
    assert private_names(text) == ["_in_backward", "_foreach_copy_", "_dynamo"]
    assert private_names("`__init__`, `grad_dtype`, max_grad_norm") == []


@pytest.mark.parametrize("page", ["README.md", "docs/index.md"])
def test_the_first_screen_links_should_i_use_it_and_names_where_it_saves_nothing(page):
    screen = first_screen(ROOT / page)
    assert "should-i-use-it.md" in screen
    for engine in WHERE_IT_SAVES_NOTHING:
        assert engine.lower() in screen.lower(), engine


def test_should_i_use_it_names_where_it_saves_nothing_and_where_not_to_use_it():
    text = (DOCS / "should-i-use-it.md").read_text(encoding="utf-8")
    for engine in WHERE_IT_SAVES_NOTHING:
        assert engine.lower() in text.lower(), engine
    for refused in ["capturable=True", "Sparse gradients", "16-bit weights"]:
        assert refused in text, refused

"""The README stays short and the documentation site stays whole.

Checks only files: README.md's length, that every page under docs/ is in
mkdocs.yml's nav, and that docs/c-api.md names every zs_* function
include/zeroshard/zeroshard.h declares. (scripts/test.sh builds the site
with mkdocs --strict, which catches broken links.)
"""
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _nav_pages():
    text = (ROOT / "mkdocs.yml").read_text()
    nav = text[text.index("\nnav:"):]
    return set(re.findall(r"([\w./-]+\.md)\s*$", nav, flags=re.M))


def _header_functions():
    header = (ROOT / "include" / "zeroshard" / "zeroshard.h").read_text()
    header = re.sub(r"/\*.*?\*/", "", header, flags=re.S)
    header = re.sub(r"//[^\n]*", "", header)
    return sorted(set(re.findall(r"\bZS_API\b[^;{]*?\b(zs_[a-z0-9_]+)\s*\(", header)))


def test_readme_is_at_most_250_lines():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; move detail into docs/"


def test_every_docs_page_is_in_the_nav():
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    nav = _nav_pages()
    assert pages, "no pages under docs/"
    assert not pages - nav, f"pages missing from mkdocs.yml's nav: {sorted(pages - nav)}"
    assert not nav - pages, f"nav names pages that do not exist: {sorted(nav - pages)}"


def test_c_api_page_names_every_function_of_the_header():
    functions = _header_functions()
    assert len(functions) > 50, "the header parse found too few functions"
    page = (ROOT / "docs" / "c-api.md").read_text()
    missing = [f for f in functions if not re.search(r"\b" + f + r"\b", page)]
    assert not missing, f"docs/c-api.md does not name: {missing}"

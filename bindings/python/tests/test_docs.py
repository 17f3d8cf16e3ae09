"""The README stays short and the documentation site stays whole.

Checks only files: README.md's length, that every page under docs/ is in
mkdocs.yml's nav, and that docs/c-api.md names every zs_* function
include/zeroshard/zeroshard.h declares, and that the config page's table of
keys the engine does not act on is impl/config/inactive.cpp's, key, value
and reason (a last column, what DeepSpeed does, is the page's own).
(scripts/test.sh builds the site with mkdocs --strict, which catches broken
links.)
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


def _inactive_rules():
    """(key, value that changes nothing, reason) of every rule in
    impl/config/inactive.cpp's table, its named reasons resolved."""
    source = (ROOT / "impl" / "config" / "inactive.cpp").read_text()
    named = dict(re.findall(r'constexpr const char\* (k\w+) =\s*((?:"[^"]*"\s*)+);', source))
    named = {k: "".join(re.findall(r'"([^"]*)"', v)) for k, v in named.items()}
    table = source[source.index("kRules = {"):source.index("return kRules;")]
    rules = []
    for key, value, reason in re.findall(r'\{"([\w.]+)",\s*([^,]+),\s*((?:"[^"]*"\s*)+|k\w+)\}', table):
        text = named[reason] if reason in named else "".join(re.findall(r'"([^"]*)"', reason))
        rules.append((key, value.strip(), text))
    return rules


def test_config_page_lists_every_key_the_engine_does_not_act_on_as_the_engine_does():
    rules = _inactive_rules()
    assert len(rules) >= 20, "the rule table of impl/config/inactive.cpp was not found"
    page = (ROOT / "docs" / "config.md").read_text()
    header = "| key | value that changes nothing | what the engine does |"
    assert header in page, "docs/config.md has no table of the keys the engine does not act on"
    table = page[page.index(header):].split("\n\n", 1)[0]
    rows = dict((m[0], (m[1], m[2])) for m in re.findall(r"^\| `([\w.]+)` \| `([^`]+)` \| (.+?) \|(?: [^|]+ \|)?$", table, re.M))
    for key, value, reason in rules:
        assert key in rows, f"docs/config.md does not list {key}, which inactive.cpp does not act on"
        want = {"true": "true", "false": "false"}.get(value, value)
        assert rows[key][0] == want, f"{key}: the page says {rows[key][0]}, inactive.cpp {want}"
        assert rows[key][1] == reason, f"{key}: the page says '{rows[key][1]}', the engine '{reason}'"
    stale = set(rows) - {r[0] for r in rules}
    assert not stale, f"docs/config.md lists as inactive keys the engine acts on: {sorted(stale)}"

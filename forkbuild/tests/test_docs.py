"""README and docs/: links reach files and headings (GitHub's ids), each `make TARGET`
exists, the README links every page, stays short; `make help` names variables, logs."""

import itertools
import re
import shlex
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote

import pytest
from markdown_it import MarkdownIt
from markdown_it.token import Token
from mdit_py_plugins.anchors import anchors_plugin

from forkbuild.core import pins

REPO_ROOT = pins.REPO_ROOT
README_MAX_WORDS = 1800  # a landing page; the rest lives in docs/


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# -- Markdown, parsed by markdown-it-py (CommonMark) with GitHub's heading ids ---------
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")  # https:, mailto:, //host
_MARKDOWN = MarkdownIt("commonmark").use(anchors_plugin, max_level=6)


class _HtmlTargets(HTMLParser):
    """The targets (href, src) and anchors (name, id) of inline HTML."""

    def __init__(self, html: str) -> None:
        super().__init__()
        self.targets: list[str] = []
        self.anchors: set[str] = set()
        self.feed(html)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value and name in ("href", "src"):
                self.targets.append(value)
            elif value and tag == "a" and name in ("name", "id"):
                self.anchors.add(value)


def _tokens(text: str) -> list[tuple[int, Token]]:
    """(line, token) of every block token and of each inline token's children."""
    found = []
    for token in _MARKDOWN.parse(text):
        line = token.map[0] + 1 if token.map else 0
        found.append((line, token))
        for child in token.children or []:
            found.append((line, child))
            line += child.type in ("softbreak", "hardbreak")
    return found


def _html(text: str) -> list[tuple[int, _HtmlTargets]]:
    html = [(n, t) for n, t in _tokens(text) if t.type in ("html_inline", "html_block")]
    return [(line, _HtmlTargets(token.content)) for line, token in html]


def anchors(text: str) -> set[str]:
    """TEXT's heading ids (GitHub's: github-slugger's rules, repeats numbered x, x-1,
    ...) and HTML anchors."""
    ids = {t.attrs["id"] for _, t in _tokens(text) if t.type == "heading_open"}
    return ids.union(*(html.anchors for _, html in _html(text)))


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of PATH's links, images and reference definitions, not code."""
    text = path.read_text()
    env: dict = {}
    _MARKDOWN.parse(text, env)  # fills env with the reference definitions
    found = [(0, ref["href"]) for ref in env.get("references", {}).values()]
    for line, token in _tokens(text):
        if token.type in ("link_open", "image"):
            attribute = "src" if token.type == "image" else "href"
            found.append((line, token.attrs[attribute]))
    found += [(line, t) for line, html in _html(text) for t in html.targets]
    return found


def _link_problem(root: Path, doc: Path, target: str) -> str | None:
    path_part, _, fragment = target.partition("#")
    path_part = unquote(path_part)
    # from the repository's root where it starts with /, as on GitHub
    dest = root / path_part[1:] if path_part[:1] == "/" else doc.parent / path_part
    dest = (dest if path_part else doc).resolve()
    if not dest.is_relative_to(root.resolve()):
        return "outside the repository"
    if not dest.exists():
        return "no such file"
    if fragment and dest.suffix == ".md":
        if unquote(fragment) not in anchors(dest.read_text()):
            return f"no heading #{fragment} in {dest.relative_to(root.resolve())}"
    elif fragment and not re.fullmatch(r"L\d+(-L\d+)?", fragment):
        return f"#{fragment} names no line of a file that is not Markdown"
    return None


def broken_links(root: Path) -> list[str]:
    """'FILE:LINE: TARGET: why' for each relative link under ROOT leading nowhere."""
    return [
        f"{doc.relative_to(root)}:{number}: {target}: {problem}"
        for doc in doc_files(root)
        for number, target in links(doc)
        if not _EXTERNAL.match(target) and (problem := _link_problem(root, doc, target))
    ]


# -- make targets ----------------------------------------------------------------------
_MAKE = re.compile(r"(?<![\w./-])make(?![\w.-])")


def _make_target(rest: str) -> str | None:
    """The target of a `make` call followed by REST: options and VAR=value skipped."""
    try:
        words = shlex.split(rest, comments=True)
    except ValueError:  # an unbalanced quote in the snippet
        words = rest.split()
    for word in words:
        if word in ("&&", "||", ";", "|") or word.startswith("#"):
            return None
        if not (word.startswith("-") or "=" in word):
            return word if re.fullmatch(r"[A-Za-z0-9][\w.-]*", word) else None
    return None  # `make` alone names none


def make_targets_named(text: str) -> list[tuple[int, str]]:
    """(line, target) of each `make ...` in code (in prose "make" is a verb)."""
    found = []
    for line, token in _tokens(text):
        if token.type in ("fence", "code_block", "code_inline"):
            # a fence's code starts below its line; inline code is on one line
            first, step = line + (token.type == "fence"), token.type != "code_inline"
            for index, snippet in enumerate(token.content.splitlines()):
                calls = _MAKE.finditer(snippet)
                targets = [_make_target(snippet[call.end() :]) for call in calls]
                found += [(first + index * step, t) for t in targets if t]
    return found


def unknown_make_targets(root: Path) -> list[str]:
    rule = r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)"  # the Makefile's `name:`, not `name :=`
    targets = set(re.findall(rule, (root / "Makefile").read_text(), re.M))
    return [
        f"{doc.relative_to(root)}:{number}: make {target}"
        for doc in doc_files(root)
        for number, target in make_targets_named(doc.read_text())
        if target not in targets
    ]


# -- the checks on this repository -----------------------------------------------------
def test_docs_relative_links_lead_to_files_and_headings():
    assert broken_links(REPO_ROOT) == []


def test_docs_name_only_make_targets_that_exist():
    docs = doc_files(REPO_ROOT)
    named = {t for doc in docs for _, t in make_targets_named(doc.read_text())}
    assert {"serve", "test", "wheel", "matrix", "help"} <= named  # checker sees them
    assert unknown_make_targets(REPO_ROOT) == []


def test_docs_readme_is_a_landing_page_linking_every_page():
    words = len((REPO_ROOT / "README.md").read_text().split())  # as `wc -w` counts
    assert words <= README_MAX_WORDS, f"README.md: {words} words; move detail to docs/"
    targets = [t for _, t in links(REPO_ROOT / "README.md") if not _EXTERNAL.match(t)]
    linked = {(REPO_ROOT / unquote(t.partition("#")[0])).resolve() for t in targets}
    pages = sorted((REPO_ROOT / "docs").glob("*.md"))
    assert pages
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_make_help_lists_the_environment_and_where_logs_go_as_the_docs_do():
    make = ["make", "-s", "help", f"PYTHON={sys.executable}"]
    text = subprocess.check_output(make, cwd=REPO_ROOT, text=True)
    # Every VLLM_FORK_* variable forkbuild reads, found in its sources.
    source = "".join(p.read_text() for p in (REPO_ROOT / "forkbuild").rglob("*.py"))
    read = r"""environ(?:\.get\(|\[)\s*["'](VLLM_FORK_\w+)["']"""
    variables = set(re.findall(read, source))
    assert {"VLLM_FORK_CACHE", "VLLM_FORK_BUILD", "VLLM_FORK_DIST"} <= variables
    files_doc = (REPO_ROOT / "docs" / "files-and-uninstall.md").read_text()
    for variable in variables:
        assert variable in text and variable in files_doc, variable
    for where in ("build/test-results", "build/models", "build/gpu-nightly"):
        assert where in text and where in files_doc, where
    # The help prints the Makefile's whole leading comment block, however long it grows.
    lines = (REPO_ROOT / "Makefile").read_text().splitlines()
    comments = itertools.takewhile(lambda line: not line or line[0] == "#", lines)
    header = [re.sub(r"^# ?", "", line) for line in comments]
    assert len(header) > 10 and text.startswith("\n".join(header) + "\n")


# -- the checks fail where they must ---------------------------------------------------
AFFECTED = "Who is affected: the connectors that reach the packed reshape"
ANCHORS = {
    "vLLM 0.25.1 + the fix for #47054": "vllm-0251--the-fix-for-47054",
    "What `make test` runs": "what-make-test-runs",
    "The fork's CPU test modules": "the-forks-cpu-test-modules",
    AFFECTED: "who-is-affected-the-connectors-that-reach-the-packed-reshape",
    "Set-up and the [locks](x.md)": "set-up-and-the-locks",
}
PAGES = [(f"# {heading}", {anchor}) for heading, anchor in ANCHORS.items()]
# Repeated headings are numbered; code holds no heading.
REPEATED = "# Title\n\n## Notes\n\n```console\n# not a heading\n```\n\n## Notes ##\n"
PAGES.append((REPEATED, {"title", "notes", "notes-1"}))


@pytest.mark.parametrize(("text", "ids"), PAGES)
def test_github_anchor_rules_for_docs_headings(text, ids):
    assert anchors(text) == ids


def _copy_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "docs", root / "docs")  # makes ROOT too
    for name in ("README.md", "Makefile"):
        shutil.copy2(REPO_ROOT / name, root / name)
    return root


def test_docs_link_check_fails_on_a_broken_link(tmp_path):
    root = _copy_docs(tmp_path)
    before = set(broken_links(root))  # a copy without the rest of the repository
    tests_page = root / "docs" / "tests.md"
    lines = tests_page.read_text().count("\n")
    with tests_page.open("a") as page:
        page.write(
            "\nSee [the missing page](no-such-page.md), [a missing heading]"
            "(setup-and-locks.md#no-such-heading), [up and out](../../outside.md),\n"
            "and `[code](no-such-file-in-code.md)` which is no link.\n"
        )
    (root / "docs" / "affected.md").unlink()  # README.md links it
    new = set(broken_links(root)) - before
    assert f"docs/tests.md:{lines + 2}: no-such-page.md: no such file" in new
    assert any("setup-and-locks.md#no-such-heading: no heading" in p for p in new), new
    assert any("../../outside.md: outside the repository" in p for p in new), new
    readme = [p for p in new if p.startswith("README.md:")]
    assert any("docs/affected.md: no such file" in p for p in readme), new
    assert not any("no-such-file-in-code.md" in p for p in new)


def test_docs_make_target_check_fails_on_an_unknown_target(tmp_path):
    root = _copy_docs(tmp_path)
    assert unknown_make_targets(root) == []
    with (root / "README.md").open("a") as readme:
        readme.write(
            "\nRun `make frobnicate ROUTE=cpu`, or `make` alone, then redraw with\n"
            "`python3 docs/make_packed_block_svg.py`; make sure of it.\n\n"
            "```console\n$ make -s VERSION=1 lint-all   # no such target\n```\n"
        )
    found = unknown_make_targets(root)
    assert len(found) == 2, found
    assert [f.rsplit(": ", 1)[1] for f in found] == ["make frobnicate", "make lint-all"]

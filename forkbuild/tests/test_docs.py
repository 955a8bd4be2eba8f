"""The README and docs/ hold together: every relative link points at a file of this
repository, and at a heading of it where the link names one (by GitHub's anchor rules);
every `make TARGET` they show is a target of the Makefile; the README links every page
of docs/ and stays a landing page; `make help` names the environment variables forkbuild
reads and where the logs go. Each check is shown to fail on a broken copy."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

from forkbuild.core import pins

REPO_ROOT = pins.REPO_ROOT
README_MAX_WORDS = 1800  # a landing page; the rest lives in docs/


def doc_files(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


# -- Markdown, as far as links, headings and commands need it --------------------------

_FENCE = re.compile(r"^\s*(`{3,}|~{3,})")
_CODE_SPAN = re.compile(r"(`+)(.+?)\1")
_HEADING = re.compile(r"^ {0,3}#{1,6}\s+(.*?)(?:\s+#+)?\s*$")
_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)"
)
_REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
_HTML_TARGET = re.compile(r"""\b(?:href|src)\s*=\s*["']([^"']+)["']""")
_HTML_ANCHOR = re.compile(r"""<a\s[^>]*\b(?:name|id)\s*=\s*["']([^"']+)["']""")
_EXTERNAL = re.compile(r"^(?:[a-zA-Z][a-zA-Z0-9+.-]*:|//)")  # https:, mailto:, //host


def split_fences(text: str) -> tuple[list[tuple[int, str]], list[tuple[int, str]]]:
    """(prose, code): the numbered lines outside and inside fenced code blocks."""
    prose, code, fence = [], [], None
    for number, line in enumerate(text.splitlines(), 1):
        opened = _FENCE.match(line)
        if fence is None and opened:
            fence = opened[1]
        elif (
            fence
            and opened
            and opened[1].startswith(fence)
            and line.strip() == opened[1]
        ):
            # a closing fence: the same character, at least as long, nothing after
            fence = None
        else:
            (code if fence else prose).append((number, line))
    return prose, code


def github_anchor(heading: str) -> str:
    """The id GitHub gives a heading: its rendered text, lower case, without punctuation
    (letters, digits, '_', '-' and spaces stay), spaces as '-' (github-slugger)."""
    text = _CODE_SPAN.sub(lambda m: m[2], heading.strip())
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link renders as its text
    text = re.sub(r"<[^>]+>", "", text).replace("*", "")  # inline HTML, emphasis
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading id of PATH as GitHub numbers repeats (x, x-1, x-2, ...), plus HTML
    anchors."""
    prose, _ = split_fences(path.read_text())
    seen: dict[str, int] = {}
    found = set()
    for _, line in prose:
        found.update(_HTML_ANCHOR.findall(line))
        heading = _HEADING.match(line)
        if not heading:
            continue
        base = slug = github_anchor(heading[1])
        while slug in seen:
            seen[base] += 1
            slug = f"{base}-{seen[base]}"
        seen[slug] = 0
        found.add(slug)
    return found


def links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every link and image of PATH outside code."""
    prose, _ = split_fences(path.read_text())
    found = []
    for number, line in prose:
        line = _CODE_SPAN.sub("", line)
        for pattern in (_LINK, _REFERENCE, _HTML_TARGET):
            found += [(number, target) for target in pattern.findall(line)]
    return found


def broken_links(root: Path) -> list[str]:
    """'FILE:LINE: TARGET: why' for each relative link of the docs under ROOT that leads
    nowhere."""
    problems = []
    for doc in doc_files(root):
        for number, target in links(doc):
            if _EXTERNAL.match(target):
                continue
            where = f"{doc.relative_to(root)}:{number}: {target}"
            path_part, _, fragment = target.partition("#")
            path_part = unquote(path_part)
            if not path_part:
                dest = doc
            elif path_part.startswith("/"):  # GitHub: from the repository's root
                dest = root / path_part.lstrip("/")
            else:
                dest = doc.parent / path_part
            dest = dest.resolve()
            if not dest.is_relative_to(root.resolve()):
                problems.append(f"{where}: outside the repository")
            elif not dest.exists():
                problems.append(f"{where}: no such file")
            elif fragment and dest.suffix == ".md":
                if unquote(fragment) not in anchors(dest):
                    problems.append(
                        f"{where}: no heading #{fragment} in "
                        f"{dest.relative_to(root.resolve())}"
                    )
            elif fragment and not re.fullmatch(r"L\d+(-L\d+)?", fragment):
                problems.append(
                    f"{where}: #{fragment} names no line of a file that is not Markdown"
                )
    return problems


# -- make targets ----------------------------------------------------------------------

_MAKE = re.compile(r"(?<![\w./-])make(?![\w.-])")


def makefile_targets(makefile: Path) -> set[str]:
    """The targets the Makefile has rules for (`name:`, not `name :=` assignments)."""
    return set(
        re.findall(r"^([A-Za-z0-9][\w.-]*)\s*:(?!=)", makefile.read_text(), re.M)
    )


def make_targets_named(text: str) -> list[tuple[int, str]]:
    """(line, target) of every `make ...` command in code: inline code and fenced blocks
    (in prose, "make" is a verb). Options and VAR=value are skipped; `make` alone names
    none."""
    prose, code = split_fences(text)
    snippets = [
        (n, span[2]) for n, line in prose for span in _CODE_SPAN.finditer(line)
    ] + code
    found = []
    for number, snippet in snippets:
        for call in _MAKE.finditer(snippet):
            rest = snippet[call.end() :]
            try:
                words = shlex.split(rest, comments=True)
            except ValueError:  # an unbalanced quote in the snippet
                words = rest.split()
            for word in words:
                if word in ("&&", "||", ";", "|") or word.startswith("#"):
                    break
                if word.startswith("-") or "=" in word:
                    continue
                if re.fullmatch(r"[A-Za-z0-9][\w.-]*", word):
                    found.append((number, word))
                break
    return found


def unknown_make_targets(root: Path) -> list[str]:
    targets = makefile_targets(root / "Makefile")
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
    named = {
        t
        for doc in doc_files(REPO_ROOT)
        for _, t in make_targets_named(doc.read_text())
    }
    # the checker sees them
    assert {"serve", "test", "wheel", "matrix", "help"} <= named
    assert unknown_make_targets(REPO_ROOT) == []


def test_docs_every_page_is_linked_from_the_readme():
    readme = REPO_ROOT / "README.md"
    linked = {
        (readme.parent / unquote(t.partition("#")[0])).resolve()
        for _, t in links(readme)
        if not _EXTERNAL.match(t)
    }
    pages = sorted((REPO_ROOT / "docs").glob("*.md"))
    assert pages
    assert [p.name for p in pages if p.resolve() not in linked] == []


def test_docs_readme_is_a_landing_page():
    words = len((REPO_ROOT / "README.md").read_text().split())  # as `wc -w` counts
    assert words <= README_MAX_WORDS, (
        f"README.md has {words} words: move detail to docs/"
    )


def test_make_help_lists_the_environment_and_where_logs_go_as_the_docs_do():
    text = subprocess.run(
        ["make", "-s", "help", f"PYTHON={sys.executable}"],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    # Every VLLM_FORK_* variable forkbuild reads, found in its sources.
    source = "".join(p.read_text() for p in (REPO_ROOT / "forkbuild").rglob("*.py"))
    variables = set(
        re.findall(r"""environ(?:\.get\(|\[)\s*["'](VLLM_FORK_\w+)["']""", source)
    )
    assert {"VLLM_FORK_CACHE", "VLLM_FORK_BUILD", "VLLM_FORK_DIST"} <= variables
    files_doc = (REPO_ROOT / "docs" / "files-and-uninstall.md").read_text()
    for variable in variables:
        assert variable in text, variable
        assert variable in files_doc, variable
    for where in ("build/test-results", "build/models", "build/gpu-nightly"):
        assert where in text and where in files_doc, where
    # The help prints the Makefile's whole leading comment block, however long it grows.
    header = []
    for line in (REPO_ROOT / "Makefile").read_text().splitlines():
        if line and not line.startswith("#"):
            break
        header.append(re.sub(r"^# ?", "", line))
    assert len(header) > 10 and text.startswith("\n".join(header) + "\n")


# -- the checks fail where they must ---------------------------------------------------


def test_github_anchor_rules_for_docs_headings(tmp_path):
    assert (
        github_anchor("vLLM 0.25.1 + the fix for #47054")
        == "vllm-0251--the-fix-for-47054"
    )
    assert github_anchor("What `make test` runs") == "what-make-test-runs"
    assert github_anchor("The fork's CPU test modules") == "the-forks-cpu-test-modules"
    assert (
        github_anchor("Who is affected: the connectors that reach the packed reshape")
        == "who-is-affected-the-connectors-that-reach-the-packed-reshape"
    )
    assert github_anchor("Set-up and the [locks](x.md)") == "set-up-and-the-locks"
    page = tmp_path / "page.md"
    page.write_text(
        "# Title\n\n## Notes\n\n```console\n# not a heading\n```\n\n## Notes ##\n"
    )
    assert anchors(page) == {"title", "notes", "notes-1"}


def _copy_docs(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copy2(REPO_ROOT / "README.md", root / "README.md")
    shutil.copy2(REPO_ROOT / "Makefile", root / "Makefile")
    shutil.copytree(REPO_ROOT / "docs", root / "docs")
    return root


def test_docs_link_check_fails_on_a_broken_link(tmp_path):
    root = _copy_docs(tmp_path)
    before = set(broken_links(root))  # a copy without the rest of the repository
    tests_page = root / "docs" / "tests.md"
    lines = tests_page.read_text().count("\n")
    with tests_page.open("a") as page:
        page.write(
            "\nSee [the missing page](no-such-page.md), [a missing heading]"
            "(setup-and-locks.md#no-such-heading), [up and "
            "out](../../outside.md),\n"
            "and `[code](no-such-file-in-code.md)` which is no link.\n"
        )
    (root / "docs" / "affected.md").unlink()  # README.md links it
    new = set(broken_links(root)) - before
    assert f"docs/tests.md:{lines + 2}: no-such-page.md: no such file" in new
    assert any("setup-and-locks.md#no-such-heading: no heading" in p for p in new), new
    assert any("../../outside.md: outside the repository" in p for p in new), new
    assert any(
        p.startswith("README.md:") and "docs/affected.md: no such file" in p
        for p in new
    ), new
    assert not any("no-such-file-in-code.md" in p for p in new)


def test_docs_make_target_check_fails_on_an_unknown_target(tmp_path):
    root = _copy_docs(tmp_path)
    assert unknown_make_targets(root) == []
    with (root / "README.md").open("a") as readme:
        readme.write(
            "\nRun `make frobnicate ROUTE=cpu`, or `make` alone, then redraw "
            "with\n"
            "`python3 docs/make_packed_block_svg.py`; make sure of it.\n\n"
            "```console\n$ make -s VERSION=1 lint-all   # no such "
            "target\n```\n"
        )
    found = unknown_make_targets(root)
    assert len(found) == 2, found
    assert found[0].endswith(": make frobnicate") and found[1].endswith(
        ": make lint-all"
    )

"""docs/backport-audit.md sorts every change rebase.AUDIT_RELEASE made to the files the
#47054 configuration runs: each differing audited file has a row in its table
(rebase.unsorted_files, shown to fail on a broken copy)."""

import io
import tarfile
from pathlib import Path

import pytest

from forkbuild.core import pins
from forkbuild.core.errors import ForkError
from forkbuild.setup import fetch, install, tree
from forkbuild.upstream import rebase


def _pip() -> Path:
    if not install.venv_python().exists():
        pytest.skip("the sdist is not cached and no toolchain venv can fetch it")
    return install.venv_python()


@pytest.fixture(scope="module")
def sdists(fork_pins: pins.Pins) -> list[Path]:
    wanted = (fork_pins.sdist, fork_pins.release(rebase.AUDIT_RELEASE).sdist)
    try:
        return [fetch.fetch(artifact, _pip, quiet=True) for artifact in wanted]
    except ForkError as exc:
        pytest.skip(f"an sdist is not cached and cannot be fetched: {exc}")


def test_every_changed_audited_file_has_a_row_in_the_audit(sdists):
    audited = rebase.audited_set()
    offloading = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/worker.py"
    flash_attn = "vllm/v1/attention/backends/flash_attn.py"  # the GPU path, added
    assert {offloading, "vllm/v1/worker/gpu/attn_utils.py", flash_attn} <= set(audited)
    assert rebase.unsorted_files(*sdists, audited, rebase.AUDIT_DOC.read_text()) == []


def test_the_file_table_names_only_audited_files():
    table = rebase.audit_table_files(rebase.AUDIT_DOC.read_text())
    assert table == set(rebase.audited_set())


def _sdist_of(path: Path, files: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(f"{path.name.split('.')[0]}/vllm/{name}")
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return path


def test_a_changed_file_without_a_row_is_reported(tmp_path):
    old_files = {"a.py": "a = 1\n", "b.py": "b = 1\n", "same.py": "s\n"}
    old = _sdist_of(tmp_path / "old.tar.gz", {**old_files, "gone.py": "g\n"})
    new_files = {"a.py": "a = 2\n", "b.py": "b = 2\n", "same.py": "s\n"}
    new = _sdist_of(tmp_path / "new.tar.gz", new_files)
    audited = ["vllm/a.py", "vllm/b.py", "vllm/same.py", "vllm/gone.py"]
    changed = ["vllm/a.py", "vllm/b.py", "vllm/gone.py"]
    assert rebase.differing_files(old, new, audited) == changed
    doc = "| file | hunks |\n| --- | --- |\n| `vllm/a.py` | 1 |\n| a.py | 1 |\n"
    doc += "see `vllm/b.py`\n"
    # b.py is only mentioned in prose and gone.py nowhere: both are unsorted.
    assert rebase.unsorted_files(old, new, audited, doc) == changed[1:]
    doc += "| `vllm/b.py` | 1 |\n| `vllm/gone.py` | 1 |\n"
    assert rebase.unsorted_files(old, new, audited, doc) == []


def test_the_audited_set_is_read_from_its_section(tmp_path):
    listing = tmp_path / "files.txt"
    listing.write_text(
        "# header\n[audited]  # comment\nvllm/a.py\n\nvllm/b.py  # why\n[added]\n"
        "vllm/b.py  # why\n[excluded]\nvllm/c.py\n"
    )
    assert rebase.audited_set(listing) == ["vllm/a.py", "vllm/b.py"]


# -- The audit's second part: upstream's fixes after 0.26.0, by fix --------------------

# The fixes issue 28 named: each must have a row of its own.
NAMED_FIXES = ("#48411", "#47987", "#50696", "#46951", "#49226", "#52170")


def test_every_fix_the_audit_lists_is_decided_and_each_carried_one_a_patch(fork_pins):
    text = rebase.AUDIT_DOC.read_text()
    fixes = rebase.audited_fixes(text)
    assert len(fixes) >= 26
    assert rebase.audited_through(text) == fork_pins.releases[-1].version
    for named in NAMED_FIXES:
        assert any(f"[{named}]" in fix.name for fix in fixes), f"{named} has no row"
    decided = [fix.name for fix in fixes if fix.decision.startswith(rebase.DECISIONS)]
    assert decided == [fix.name for fix in fixes]
    assert rebase.unsorted_fixes(text, rebase.audited_through(text)) == []
    # and every carried fix is a patch of the series
    series = [p.name for p in tree.read_series()]
    carried = [fix for fix in fixes if fix.decision.startswith("**carry**")]
    assert carried
    for fix in carried:
        number = fix.decision.split("patch ", 1)[1][:4]
        assert any(name.startswith(number + "-") for name in series), (fix.name, number)


def test_unsorted_fixes_are_the_undecided_ones_up_to_the_release():
    rule = "| --- | --- | --- | --- | --- |\n"
    doc = (
        f"# audit\n\n## The changes\n\n| fix | a | b | c | decision |\n{rule}"
        "| [#1](u) | 0.27.0 | x | y |  |\n\n"  # a table of another section: not read
        "## After 0.26.0: fixes\n\nAudited through: 0.30.0\n\n"
        f"| fix | first release | what it fixes | hit? | decision |\n{rule}"
        "| [#10](u) | 0.27.0 (by date) | a | yes | **carry**: patch 0005 |\n"
        "| [#11](u) | 0.28.0 | b | no | not carried, because |\n"
        "| [#12](u) | 0.28.0 | c | maybe | flagged, not carried |\n"
        "| [#13](u) | 0.29.0 | d | yes |  |\n"
        "| bug [#14](u) (open) | none | e | yes | to do |\n"
        "| [#15](u) | 0.31.0 | f | yes |  |\n\n"
        "## Redoing the audit\n\n| fix | a | b | c | d |\n"
    )
    fixes = rebase.audited_fixes(doc)
    later = ["[#13](u)", "bug [#14](u) (open)", "[#15](u)"]
    names = [f"[#{n}](u)" for n in (10, 11, 12, 13)] + later[1:]
    assert [f.name for f in fixes] == names
    assert fixes[0].release == (0, 27, 0) and fixes[4].release is None
    assert rebase.audited_through(doc) == "0.30.0"
    # Up to the release tried, and the open ones whatever it is.
    assert rebase.unsorted_fixes(doc, "0.28.0") == ["bug [#14](u) (open)"]
    assert rebase.unsorted_fixes(doc, "0.29.0") == ["[#13](u)", "bug [#14](u) (open)"]
    assert rebase.unsorted_fixes(doc, "0.31.0") == later

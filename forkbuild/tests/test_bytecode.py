"""What Python compiled in one venv reaches the next fresh one made from the same files,
and Python itself still decides whether it is used."""

import os
import shutil
import subprocess
import sys
from pathlib import Path
from unittest.mock import Mock

import pytest

from forkbuild.setup import bytecode


def _site(root: Path, source: str = "VALUE = 1\n", mtime: int = 1_700_000_000) -> Path:
    """A site-packages folder with one package dated MTIME (as uv and the sdist do)."""
    (root / "pkg").mkdir(parents=True)
    for name, text in (("__init__.py", ""), ("mod.py", source)):
        (root / "pkg" / name).write_text(text)
        os.utime(root / "pkg" / name, (mtime, mtime))
    return root


def _import(site: Path) -> bytes:
    """pkg.mod's VALUE, imported in SITE by a Python free to write bytecode."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    code = "import pkg.mod; print(pkg.mod.VALUE)"
    return subprocess.check_output([sys.executable, "-c", code], cwd=site, env=env)


def _pyc(site: Path) -> Path:
    (found,) = (site / "pkg" / "__pycache__").glob("mod.*.pyc")
    return found


@pytest.fixture
def first(tmp_path: Path) -> Path:
    """A venv's site-packages whose package Python has compiled."""
    first = _site(tmp_path / "first")
    _import(first)
    return first


def test_a_fresh_venv_gets_the_bytecode_and_python_keeps_it(tmp_path, first):
    """Linked into the venv's source folders, where it has no .pyc of its own."""
    kept = tmp_path / "cache"
    assert bytecode.keep(first, kept) == 2  # pkg/__init__ and pkg/mod
    assert bytecode.keep(first, kept) == 0  # kept once
    (kept / "gone" / "__pycache__").mkdir(parents=True)
    (kept / "gone" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"not installed")
    fresh = _site(tmp_path / "fresh")
    assert bytecode.restore(fresh, kept) == 2
    assert not (fresh / "gone").exists()
    own, linked = _pyc(fresh), _pyc(fresh).stat().st_ino
    _import(fresh)
    # Python found it valid (same source mtime and size): it did not write a new one.
    assert own.stat().st_ino == linked
    assert not list(fresh.rglob("*.partial"))
    shutil.rmtree(own.parent)
    own.parent.mkdir()
    own.write_bytes(b"the venv's own")
    assert bytecode.restore(fresh, kept) == 1  # pkg/__init__ only
    assert own.read_bytes() == b"the venv's own"
    assert bytecode.restore(fresh, tmp_path / "no-cache-yet") == 0


def test_bytecode_of_a_changed_source_is_compiled_afresh_and_the_cache_is_untouched(
    tmp_path, first
):
    kept = tmp_path / "cache"
    bytecode.keep(first, kept)
    cached = (kept / _pyc(first).relative_to(first)).read_bytes()
    # A patched file: other content, another mtime (git am writes it now).
    changed = _site(tmp_path / "changed", source="VALUE = 22\n", mtime=1_800_000_000)
    bytecode.restore(changed, kept)
    assert _import(changed).strip() == b"22"
    # Python replaced the venv's file by a rename; the cache's file is as it was.
    assert (kept / _pyc(changed).relative_to(changed)).read_bytes() == cached
    assert _pyc(changed).read_bytes() != cached


def test_the_store_is_per_source_and_per_python(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_FORK_CACHE", str(tmp_path))
    one = bytecode.store("venv", b"lock one")
    assert one == bytecode.store("venv", b"lock one")
    assert one != bytecode.store("venv", b"lock two")
    assert one != bytecode.store("tree", b"lock one")
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    assert one != bytecode.store("venv", b"lock one")
    assert one.is_relative_to(tmp_path)


def test_keep_copies_across_file_systems(tmp_path, first, monkeypatch):
    cross_device = Mock(side_effect=OSError(18, "Invalid cross-device link"))
    monkeypatch.setattr(os, "link", cross_device)
    kept = tmp_path / "cache"
    assert bytecode.keep(first, kept) == 2
    pyc = kept / _pyc(first).relative_to(first)
    assert pyc.read_bytes() == _pyc(first).read_bytes()
    assert pyc.stat().st_ino != _pyc(first).stat().st_ino
    shutil.rmtree(first)
    assert pyc.exists()


def test_an_unwritable_cache_costs_compile_time_only(
    tmp_path, first, monkeypatch, capsys
):
    read_only = Mock(side_effect=OSError(30, "Read-only file system"))
    monkeypatch.setattr(os, "link", read_only)
    monkeypatch.setattr(shutil, "copy2", read_only)
    kept = tmp_path / "cache"
    assert bytecode.keep(first, kept) == 0
    assert bytecode.restore(_site(tmp_path / "fresh"), first) == 0
    assert "could not be kept" in capsys.readouterr().err
    assert not list(tmp_path.rglob("*.partial"))

"""What every step relies on: fixcheck's verdicts, preflight's refusals, the one-line
errors of run_or_fail, a pytest run's progress log and graceful stop."""

import dataclasses
import re
import signal
import socket
import sys
import tarfile

import pytest

from forkbuild.core import fixcheck, pins, preflight, pytest_progress, pytest_runner
from forkbuild.core.errors import ForkError, run_or_fail


def test_fixcheck_tells_released_from_fixed(real_sdist, fork_pins):
    inner = f"vllm-{fork_pins.upstream_version}/{fixcheck.MODULE_PATH}"
    with tarfile.open(real_sdist) as tar:
        released = tar.extractfile(inner).read().decode()
    assert fixcheck.classify(released) == "buggy"
    fixed = released.replace(".view(kv_cache_shape)", ".view(permuted_kv_cache_shape)")
    assert fixcheck.classify(fixed) == "fixed"
    # Reformatting does not fool it; code that no longer has the branch is "unknown".
    noted = fixed.replace(".view(dtype)\n", ".view(dtype)  # note\n")
    assert fixcheck.classify(noted) == "fixed"
    for gone in ("def _reshape_attention_kv_cache():\n    pass\n", "not python ("):
        assert fixcheck.classify(gone) == "unknown"


def test_unsupported_python_and_machine_are_refused(fork_pins):
    with pytest.raises(ForkError, match="is not supported: the fork locks Python 2.7"):
        preflight.check_all(dataclasses.replace(fork_pins, pythons=("2.7",)))
    with pytest.raises(ForkError, match="machine .* is not supported"):
        preflight.check_all(dataclasses.replace(fork_pins, machines=("riscv64",)))


CACHE = ("VLLM_FORK_CACHE", lambda: pins.cache_dir() / "uv-cache")


@pytest.mark.parametrize(
    ("variable", "folder"), [CACHE, ("VLLM_FORK_BUILD", pins.build_dir)]
)
def test_no_space_or_an_unwritable_folder_is_refused_with_its_variable(
    tmp_path, monkeypatch, variable, folder
):
    """Refused before work, naming the variable that moves the folder; a folder below a
    file (read-only: test_uv_cache.py) is a line, not a traceback."""
    monkeypatch.setenv(variable, str(tmp_path / "room"))
    with pytest.raises(ForkError, match="GiB free under") as err:
        preflight.check_disk(folder(), 10**9, "the test")
    assert f"set {variable} to a folder on a disk with room" in err.value.hint
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv(variable, str(tmp_path / "a-file" / "folder"))
    refused = r"cannot write in .*a-file/folder.* \(Not a directory\)"
    with pytest.raises(ForkError, match=refused) as err:
        preflight.check_disk(folder(), 1, "the test")
    assert err.value.hint == f"make it writable, or set {variable} to a writable folder"


def test_port_in_use_is_refused(monkeypatch):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        in_use = f"port {port} on 127.0.0.1 is already in use"
        with pytest.raises(ForkError, match=in_use) as err:
            preflight.check_port_free("127.0.0.1", port)
        assert "pass --port N" in err.value.hint
        # Through `make serve` (the Makefile names its variable) the advice is PORT=N.
        monkeypatch.setenv("FORKBUILD_PORT_OPTION", "PORT=N (make serve PORT=8001)")
        with pytest.raises(ForkError) as err:
            preflight.check_port_free("127.0.0.1", port)
        assert "pass PORT=N" in err.value.hint


# -- errors.run_or_fail: a failing command is one ForkError line; a report holds all
SAYS = [sys.executable, "-c", "import sys; print('out'); sys.exit('first\\nlast')"]


@pytest.mark.parametrize("logged", [False, True])
def test_a_failure_says_its_last_words_and_where_the_rest_is(tmp_path, logged):
    """Captured: the end of stderr, the hint kept; with a report: its last line."""
    done = run_or_fail([sys.executable, "-c", "print('hello')"], "cannot fail")
    assert done.stdout == "hello\n"  # a success returns the captured output
    report, hint = (tmp_path / "run.log", "") if logged else (None, "do this")
    with pytest.raises(ForkError) as err:
        run_or_fail(SAYS, "it broke", hint, report=report, tail=4)
    hint = f"see {report}" if logged else hint
    assert (err.value.cause, err.value.hint) == ("it broke: last", hint)
    if logged:
        assert report.read_text().split() == ["out", "first", "last"]
    silent = [sys.executable, "-c", "raise SystemExit(3)"]
    with pytest.raises(ForkError) as err:
        run_or_fail(silent, "it broke", report=report)
    assert err.value.cause == "it broke: no output"


# -- pytest_runner: CI sees cases done, not dots; the killed-run note names the case
CASES = """import time, pytest
@pytest.mark.parametrize("n", range(3))
def test_slow(n):
    time.sleep(0.6)
def test_z_hangs():
    time.sleep(120)
"""


def test_a_run_logs_its_progress_and_stops_gracefully_with_sigint_ignored(
    tmp_path, monkeypatch, capsys
):
    """`bash run.sh OUT &`, nohup: SIGINT comes ignored; the stop must still end it."""
    (tmp_path / "test_cases.py").write_text(CASES)
    monkeypatch.setattr(pytest_runner, "PROGRESS_EVERY_S", 0.25)
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # inherited by the run
    try:
        args = (sys.executable, tmp_path, ["test_cases.py"], tmp_path / "junit.xml")
        outcome = pytest_runner.run_pytest(*args, timeout_s=20)
    finally:
        signal.signal(signal.SIGINT, before)
    assert outcome.cases == {
        f"test_cases.py::test_slow[{n}]": "passed" for n in range(3)
    }
    assert outcome.killed.endswith("while running test_cases.py::test_z_hangs")
    logged = capsys.readouterr().err
    counts = re.findall(r"pytest in \S+: (\d) of (\d) cases done", logged)
    assert counts and {total for _, total in counts} == {"4"}, counts
    done = [int(d) for d, _ in counts]
    assert done == sorted(done) and done[-1] >= 1
    # The progress file's line, read back whole (a node id may hold spaces).
    assert pytest_progress.read("") == (0, 0, "")
    line = "2\t5\tt.py::test_x[a b]"
    assert pytest_progress.read(line) == (2, 5, "t.py::test_x[a b]")
    assert pytest_progress.read("5\t5\t") == (5, 5, "")

"""A download's bytes so far, shown with rich (not the stdlib-only bootstrap's)."""

import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from rich import progress as bars
from rich.console import Console


def _size(folder: Path) -> int:
    total = 0
    for path in folder.rglob("*"):
        with suppress(OSError):  # gone meanwhile: the downloader renamed it
            total += path.stat().st_size if path.is_file() else 0
    return total


@contextmanager
def bytes_in(folder: Path, what: str, console: Console | None = None) -> Iterator[bool]:
    """Show the bytes written under FOLDER on a terminal; yield whether it does."""
    console = console or Console(stderr=True)
    if not console.is_terminal:
        yield False
        return
    columns = (bars.SpinnerColumn(), bars.TextColumn(what), bars.DownloadColumn())
    speed = (bars.TransferSpeedColumn(), bars.TimeElapsedColumn())
    with bars.Progress(*columns, *speed, console=console) as bar:
        task = bar.add_task(what, total=None)
        stop = threading.Event()

        def watch() -> None:
            while not stop.wait(0.2):
                bar.update(task, completed=_size(folder))

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            yield True
        finally:
            stop.set()
            watcher.join()
            bar.update(task, completed=_size(folder))

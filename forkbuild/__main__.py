import sys

# Before any import that needs tomllib: an older python3 is told so in one line.
if sys.version_info < (3, 11):  # noqa: UP036
    sys.exit(
        f"forkbuild: error: Python {sys.version.split()[0]} is too old; forkbuild and "
        "the fork need Python 3.11-3.13 -- run with PYTHON=python3.11 make ..."
    )

from forkbuild.cli import main  # noqa: E402

sys.exit(main())

import sys

# Before any import that needs tomllib: an older python3 is told so in one line.
if sys.version_info < (3, 11):  # noqa: UP036
    sys.exit(
        f"forkbuild: error: Python {sys.version.split()[0]} is too old; forkbuild and "
        "the fork need Python 3.11-3.13 -- run with PYTHON=python3.11 make ..."
    )

from forkbuild.core.errors import ForkError  # noqa: E402
from forkbuild.setup import bootstrap  # noqa: E402

try:  # on the standard library alone: re-executes in the tool environment
    bootstrap.enter(sys.argv[1:])
except ForkError as exc:
    sys.exit(f"forkbuild: error: cannot make the tool environment: {exc}")
except KeyboardInterrupt:
    sys.exit("forkbuild: interrupted; run it again to resume")

from forkbuild.cli import main  # noqa: E402

sys.exit(main())

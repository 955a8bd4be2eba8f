import sys

from forkbuild.cli import main

sys.exit(main())

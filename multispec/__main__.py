"""``python -m multispec ...``: the ``multispec`` command line, for an interpreter whose scripts
folder is not on the PATH."""

import sys

from multispec.cli import main

sys.exit(main())

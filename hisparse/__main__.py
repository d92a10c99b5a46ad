"""``python -m hisparse ...``: the same command as ``hisparse ...``."""

import sys

from .tools.cli import main

sys.exit(main())

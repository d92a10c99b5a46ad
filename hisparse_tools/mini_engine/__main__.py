"""``python -m hisparse_tools.mini_engine ...``: the same as ``hisparse mini-engine ...``."""

import sys

from .cli import main

sys.exit(main())

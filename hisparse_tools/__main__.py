"""``python -m hisparse_tools ...``: the same command as ``hisparse ...``."""

import sys

from .cli import main

sys.exit(main())

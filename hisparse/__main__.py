"""``python -m hisparse ...``: the same command as ``hisparse ...``.

The command lives in the tools package, ``hisparse_tools`` (``python -m hisparse_tools``
is the same again). This entry point is the library's one reference to the tools: no
library module imports it and ``import hisparse`` never runs it
(tests/test_layers.py holds both to that).
"""

import sys

from hisparse_tools.cli import main

sys.exit(main())

"""``python -m fsd_cli …`` — the ``fsd`` command without the installed entry point."""

import sys

from fsd_cli.main import main

sys.exit(main())

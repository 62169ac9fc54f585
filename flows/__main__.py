"""``python -m flows`` = ``flux``."""

import sys

from flows.cli import main

sys.exit(main())

"""``python -m engine_bridge.engines SPEC_JSON``: serve the worker protocol through an engine (:mod:`.host`)."""

import sys

from engine_bridge.engines.host import main

sys.exit(main(sys.argv[1:]))

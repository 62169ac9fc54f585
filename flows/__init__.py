"""Flux: Prefect flows, deployments and the ``flux`` CLI.

Prefect's telemetry is off unless a user turns it on: these defaults are set before any flow module
imports prefect (the CLI, a deployment's runner and scripts all import this package first).
"""

import os

# The in-process (ephemeral) server's start took 8-13 s cold here and over Prefect's 20 s on a loaded 2-core
# machine: give it 120 s before `flux plan` gives up.
PREFECT_DEFAULTS = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_RUNNER_POLL_FREQUENCY": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
for _key, _value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

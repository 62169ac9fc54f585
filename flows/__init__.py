"""Flux: Prefect flows, deployments and the ``flux`` CLI.

Prefect's telemetry is off unless a user turns it on: these defaults are set before any flow module
imports prefect (the CLI, a deployment's runner and scripts all import this package first).
"""

import os

PREFECT_DEFAULTS = {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
                    "PREFECT_RUNNER_POLL_FREQUENCY": "1"}
for _key, _value in PREFECT_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

"""The `flux` subcommands, one module each: its argparse flags (`add`) and its handler (`flows/cli.py` dispatches)."""

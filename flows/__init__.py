"""Flux: flows."""

"""Flux: server."""

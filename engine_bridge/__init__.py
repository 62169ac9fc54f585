"""Flux: engine_bridge."""

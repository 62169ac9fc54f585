"""Flux: tasks."""

"""Flux artifacts: content ids, the store (DuckDB catalog + Parquet/JSON objects), GGUF reading and synthesis.

Only this package imports duckdb.
"""

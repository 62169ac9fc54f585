"""Flux's OpenAI-compatible server for one saved plan (``flux serve <plan>`` = ``python -m server <plan>``).

``app`` / ``routes`` (Litestar) and ``service`` (one plan's serving state) take requests; ``chat``,
``tools`` and ``formats`` render prompts and parse tool calls; ``generation`` turns a request into worker
``generate`` streams; ``supervisor`` keeps the one engine worker alive and admits work to it; ``journal``
lets a dropped client resume; ``plan_check`` refuses a plan this machine cannot serve; ``metrics`` and
``access`` are /metrics and the access log.
"""

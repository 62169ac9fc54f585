"""Tables that fit the terminal: a command offers its table's layouts, richest first, and prints the first whose
natural width fits the console (as ``flux sql`` chooses between a table and one block per row), so that rich never
squeezes ids, dates and numbers into stubs that all look alike."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

from rich.console import Console, RenderableType
from rich.measure import Measurement

L = TypeVar("L")


def natural_width(con: Console, renderable: RenderableType) -> int:
    """The width ``renderable`` takes unsqueezed (measured without the console's width as the cap)."""
    return Measurement.get(con, con.options.update(max_width=1 << 20), renderable).maximum


def first_fitting(con: Console, layouts: Sequence[L], build: Callable[[L], RenderableType]) -> tuple[L, RenderableType]:
    """The first of ``layouts`` whose ``build`` fits ``con``'s width unsqueezed, with what it built; the last when
    none does (its flexible columns then wrap)."""
    if not layouts:
        raise ValueError("no layout to choose from")
    for layout in layouts:
        built = build(layout)
        if natural_width(con, built) <= con.width:
            return layout, built
    return layouts[-1], built

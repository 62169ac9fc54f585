"""Tables that fit the terminal: a command offers its table's layouts, richest first, and prints the first that fits
the console (as ``flux sql`` chooses between a table and one block per row), so that rich never squeezes ids, dates
and numbers into stubs that all look alike. A layout fits when its columns that do not wrap fit whole beside those
that do at their ``min_width`` (a wrapping column of prose, such as an error, is read in lines of that width, never
one word per line)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

from rich.console import Console, RenderableType
from rich.measure import Measurement
from rich.table import Table

L = TypeVar("L")


def natural_width(con: Console, renderable: RenderableType) -> int:
    """The width ``renderable`` takes unsqueezed (measured without the console's width as the cap)."""
    return Measurement.get(con, con.options.update(max_width=1 << 20), renderable).maximum


def least_width(con: Console, renderable: RenderableType) -> int:
    """The narrowest ``renderable`` can be without cutting a column that does not wrap (a wrapping one at its longest
    word or its ``min_width``)."""
    return Measurement.get(con, con.options.update(max_width=1 << 20), renderable).minimum


def first_fitting(con: Console, layouts: Sequence[L], build: Callable[[L], RenderableType]) -> tuple[L, RenderableType]:
    """The first of ``layouts`` whose ``build`` fits ``con``'s width (:func:`least_width`), with what it built; the
    last when none does (its wrapping columns then fold)."""
    if not layouts:
        raise ValueError("no layout to choose from")
    for layout in layouts:
        built = build(layout)
        if least_width(con, built) <= con.width:
            return layout, built
    return layouts[-1], built


def whole_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, wraps: Mapping[str, int] | None = None,
                left: Sequence[str] = (), **table: Any) -> Table:
    """A table whose columns are never narrower than their longest cell and header line, so that nothing is cut (rich
    would cut a column that does not wrap), but those in ``wraps`` (header -> least width), which fold instead.
    ``left``: the headers of left-aligned columns (the others are numbers, aligned right)."""
    t = Table(**table)
    for i, head in enumerate(headers):
        widest = max([len(r[i]) for r in rows] + [len(x) for x in head.split("\n")])
        wrap = (wraps or {}).get(head)
        t.add_column(head, justify="left" if head in left else "right", no_wrap=wrap is None, overflow="fold",
                     min_width=widest if wrap is None else min(wrap, widest))
    for r in rows:
        t.add_row(*r)
    return t

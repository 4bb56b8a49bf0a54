"""What the CLI prints of text from outside (rich markup)."""

from __future__ import annotations

from ledger.domain.display import displayable


def shown(text: str) -> str:
    """``text`` for a rich table or line: what a terminal would act on written as a visible
    escape (:mod:`ledger.domain.display`), and rich's own markup escaped."""
    from rich.markup import escape  # noqa: PLC0415  (rich loads only for commands that print)

    return escape(displayable(text))

"""How the `skewserve` command writes for people.

Rich reads `[...]` in a string as markup: a path like `runs/x[/test]` or an error quoting one would
crash the print or lose characters. Text that comes from users, files or exceptions therefore goes
through `text()` (or `escape`) and only our own labels carry styles.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.text import Text

__all__ = ["console", "err_console", "error", "escape", "notice", "say", "text"]


def _width() -> int | None:
    # Wide enough when piped (tests, logs) that endpoint URLs and paths are never cut.
    return None if Console().is_terminal else 200


console = Console(width=_width())
err_console = Console(stderr=True, width=_width())


def text(value: object, style: str = "") -> Text:
    """`value` as literal text: never parsed as markup."""
    return Text(str(value), style=style)


def say(message: object) -> None:
    """Print `message` verbatim (no markup) on one line, however long."""
    console.print(text(message), soft_wrap=True)


def error(message: object, label: str = "error") -> None:
    """Print `label: message` with the label in red and the message verbatim."""
    console.print(Text.assemble((f"{label}:", "red"), " ", str(message)), soft_wrap=True)


def notice(message: object, label: str = "notice", to_stderr: bool = False) -> None:
    """Print `label: message` with the label in yellow and the message verbatim."""
    target = err_console if to_stderr else console
    target.print(Text.assemble((f"{label}:", "yellow"), " ", str(message)), soft_wrap=True)

"""What the commands' options share: plain-text help, comma lists, commands built from typed options."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from pydantic import ValidationError

# Help is plain text, never Rich markup: help strings such as "train/val[/test]" must print as
# written (with markup on, newer typer/rich releases crash on them: MarkupError '[/test]').
HELP_MARKUP = None

Options = TypeVar("Options")


def comma_list(value: str | None) -> list[str]:
    """The names of a comma-separated option (`us-east, eu-west` -> two names); none when unset."""
    return [part.strip() for part in (value or "").split(",") if part.strip()]


def first_error(exc: ValidationError) -> str:
    """`field: message` of a validation error's first complaint, the field as the model names it."""
    err = exc.errors()[0]
    return f"{'.'.join(str(p) for p in err['loc']) or 'config'}: {err['msg']}"


def options_command(
    options_type: type[Options],
) -> Callable[[Callable[[Options], None]], Callable[..., None]]:
    """Make `run(options)` a typer command whose parameters are the fields of the dataclass
    `options_type`, each declared once as `Annotated[type, typer.Option(...)] = default`."""
    hints = typing.get_type_hints(options_type, include_extras=True)
    params = [
        inspect.Parameter(
            field.name, inspect.Parameter.KEYWORD_ONLY, annotation=hints[field.name], default=_default(field)
        )
        for field in dataclasses.fields(options_type)  # type: ignore[arg-type]
    ]

    def decorate(run: Callable[[Options], None]) -> Callable[..., None]:
        @functools.wraps(run)
        def command(**values: Any) -> None:
            run(options_type(**values))

        # typer reads a command's parameters from its signature and type hints.
        command.__signature__ = inspect.Signature(params, return_annotation=None)  # type: ignore[attr-defined]
        command.__annotations__ = {p.name: p.annotation for p in params}
        return command

    return decorate


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    if field.default is not dataclasses.MISSING:
        return field.default
    return inspect.Parameter.empty  # required

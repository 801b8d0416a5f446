"""How deep a request's JSON may nest, bounded from its text in C-level passes.

RapidJSON in Triton recurses per level, so the gateway refuses what nests deeper than any KServe
request does. Both readers (gateway/fronts/infer_body.py, gateway/fronts/exact_json.py) ask here
first, before any value is built.
"""

from __future__ import annotations

import re
from typing import Final

# Deeper structure than any KServe request has.
MAX_DEPTH: Final = 32

_NOT_BRACKET: Final = re.compile(r"[^\[\]]+")
_NOT_OPENER: Final = re.compile(r"[^\[\]{}]+")


def brackets_deeper_than(text: str, limit: int) -> bool:
    """Whether balanced brackets in `text` (no strings in it) nest deeper than `limit`, in C-level
    passes: each pass removes the innermost pairs, so `limit` passes empty any shallower text."""
    brackets = _NOT_BRACKET.sub("", text)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "")
    return bool(brackets)


def may_nest_deeper_than(text: str, limit: int) -> bool:
    """Cheap over-estimate of nesting depth from the text (brackets inside strings count too);
    True sends the header to the walk, which measures exactly and names the place."""
    if text.count("[") + text.count("{") <= limit:
        return False
    brackets = _NOT_OPENER.sub("", text)
    for _ in range(limit):
        if not brackets:
            return False
        brackets = brackets.replace("[]", "").replace("{}", "")
    return bool(brackets)

"""What a `why` cites, without its wording: tests compare the figures a decision rests on, so rewording a message
never breaks a test and a changed number always does."""

import re

_UNIT = r"[KMGT]i?B/s|[KMGT]iB|B/param|B|ms|us|ns|s|x"
_FIGURE = re.compile(rf"\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s?(?:{_UNIT})\b)?")


def figures(text: str) -> list[str]:
    """The numbers in `text`, each with its unit when it has one, in order."""
    return [m.group().replace(" ", "") for m in _FIGURE.finditer(text)]

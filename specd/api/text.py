"""What counts as text, decided once where input enters: JSON bodies and YAML
manifests may spell lone UTF-16 surrogates (``"\\ud800"``), which Python
decodes into a ``str`` that no tokenizer, grammar or UTF-8 encoder accepts.
Both edges refuse them with the field's path, so nothing behind them meets one.
"""

from __future__ import annotations

import reprlib
from typing import Any

LONE_SURROGATE = "text holds a lone UTF-16 surrogate, which is not a Unicode character"
_SHOWN = reprlib.Repr()  # keyword arguments need Python 3.12
_SHOWN.maxlevel, _SHOWN.maxdict, _SHOWN.maxlist, _SHOWN.maxstring, _SHOWN.maxlong = 3, 6, 6, 80, 40


def has_lone_surrogate(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def lone_surrogate_path(value: Any, path: str = "") -> str | None:
    """The path (``messages[0].content``) of the first string, or object key,
    in a decoded JSON or YAML value that holds a lone surrogate; None if none.

    Iterative, and each container is visited once, so neither deep nesting nor
    a YAML alias shared many times costs more than the value's own size.
    """
    stack, seen = [(value, path)], set()
    while stack:
        item, where = stack.pop()
        if isinstance(item, str):
            if has_lone_surrogate(item):
                return where
        elif isinstance(item, (dict, list)) and id(item) not in seen:
            seen.add(id(item))
            if isinstance(item, list):
                stack.extend((child, f"{where}[{i}]") for i, child in reversed(list(enumerate(item))))
                continue
            children = []
            for key, child in item.items():
                named = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and has_lone_surrogate(key):
                    return shown_key(named)
                children.append((child, named))
            stack.extend(reversed(children))
    return None


def shown_key(path: str) -> str:
    """A path that may hold lone surrogates, with each written as ``\\udXXX``."""
    return path.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: Any) -> str:
    """A value as an error message quotes it: a bounded ``repr``, whatever its size or nesting."""
    return _SHOWN.repr(value)



"""JSON files of this machine (a model's config, a checkpoint index, a dataset row) checked for their shape.

A file that parses but has the wrong shape (a ``weight_map`` that is a list, a layer count
written as ``"8"``) is refused by :func:`expect` / :func:`field` with :class:`Malformed`: one
line naming the file, the key and what was expected; :func:`describe` words what was found::

    >>> field({"num_hidden_layers": "8"}, "num_hidden_layers", POSITIVE_INT, "config.json")
    Traceback (most recent call last):
    Malformed: config.json: num_hidden_layers is the string '8', expected a positive integer
"""
from __future__ import annotations

#: What a value must be, as :func:`expect` names it in its message.
OBJECT, LIST, STRING = "an object", "a list", "a string"
POSITIVE_INT, NON_NEGATIVE_INT = "a positive integer", "a non-negative integer"
STRING_LIST, NUMBER = "a list of strings", "a number"
_KIND_TESTS = {
    OBJECT: lambda v: isinstance(v, dict),
    LIST: lambda v: isinstance(v, list),
    STRING: lambda v: isinstance(v, str),
    POSITIVE_INT: lambda v: type(v) is int and v > 0,  # type(): True is an int, not a count
    NON_NEGATIVE_INT: lambda v: type(v) is int and v >= 0,
    STRING_LIST: lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    NUMBER: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
}


def describe(value) -> str:
    """What a JSON value is, for a message: ``"8" -> "the string '8'"``, ``[] -> 'an empty list'``."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {shown!r}"
    if isinstance(value, (int, float)):
        return f"the number {value!r}"
    if isinstance(value, dict):
        return "an empty object" if not value else f"an object (keys: {', '.join(sorted(map(str, value))[:4])})"
    if isinstance(value, list):
        return "an empty list" if not value else f"a list of {len(value)}"
    return type(value).__name__


class Malformed(Exception):
    """Content that parses but has the wrong shape: names the file, the key and what was expected.

    :param file: the file as the user knows it (``config.json``, ``model.safetensors.index.json``).
    :param key: where in it, dotted (``text_config.num_hidden_layers``); empty for the whole file.
    :param expected: what belongs there (``"a positive integer"``).
    :param value: what was found (described, never dumped whole).
    :param fix: the hint for the fail record (default: fix that key, or re-download the file).
    """

    def __init__(self, file: str, key: str, expected: str, value=None, fix: str | None = None, found=None):
        self.file, self.key, self.expected = file, key, expected
        self.found = found if found is not None else describe(value)
        where = f"{file}: {key}" if key else f"{file}"
        super().__init__(f"{where} is {self.found}, expected {expected}")
        self.summary = str(self)
        self.fix = fix or (f"fix {key} in {file} (or re-download the file)" if key else f"re-download {file}")

    def detail(self) -> dict:
        return {"file": self.file, "key": self.key, "expected": self.expected, "found": self.found}


def expect(value, kind: str, file: str, key: str, fix: str | None = None):
    """``value`` itself when it is of ``kind`` (one of the kind constants above); else raise :class:`Malformed`."""
    if not _KIND_TESTS[kind](value):
        raise Malformed(file, key, kind, value, fix=fix)
    return value


def field(mapping: dict, key: str, kind: str, file: str, where: str = "", required: bool = False,
          fix: str | None = None):
    """``mapping[key]`` checked to be of ``kind``; None when absent or null unless ``required``.

    :param where: the dotted path of ``mapping`` inside the file (``"text_config"``), for the message.
    """
    path = f"{where}.{key}" if where else key
    value = mapping.get(key)
    if value is None:
        if required:
            raise Malformed(file, path, kind, found="missing" if key not in mapping else "null", fix=fix)
        return None
    return expect(value, kind, file, path, fix=fix)

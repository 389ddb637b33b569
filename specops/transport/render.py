"""Render the entry scripts the host runs, from ``templates/`` with jinja2.

Rules that make a rendered script safe to send anywhere:

* undefined template variables are errors (``StrictUndefined``);
* user values enter only as data: one base64 literal of a JSON object, so quotes,
  ``$(...)``, backticks, newlines or a line equal to a heredoc delimiter are inert;
* the module name is checked against an identifier pattern, never user text;
* the result is ASCII and ends with a newline, so a heredoc carries it byte for byte.
"""
from __future__ import annotations

import base64
import json
import re
import secrets
from functools import lru_cache

import jinja2

from specops import __version__, wire
from specops.transport.assets import asset

_MODULE = re.compile(r"^[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*$")


@lru_cache(maxsize=None)
def _env() -> jinja2.Environment:
    """The jinja2 environment over this install's ``templates/`` (made on first use)."""
    return jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(asset("templates"))),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
    )


def b64_json(value) -> str:
    """Encode any JSON-able value as a base64 literal (alphabet ``A-Za-z0-9+/=``)."""
    return base64.b64encode(json.dumps(value, ensure_ascii=False).encode("utf-8")).decode("ascii")


def render(template: str, **context) -> str:
    """Render ``templates/<template>`` with ``context``; the output always ends with a newline."""
    text = _env().get_template(template).render(**context)
    if not text.isascii():
        raise ValueError(f"template {template} rendered non-ASCII text; pass values via b64_json")
    return text if text.endswith("\n") else text + "\n"


def render_entry(task: str, params: dict, bundle_zip: bytes | None = None) -> str:
    """The entry script that imports the task's module (``remote.<module>``, by
    :data:`remote.wire.protocol.TASKS`) and calls its ``main(params)``.

    :param bundle_zip: embed the bundle itself (for heredoc delivery to a host that lacks it).
    """
    module = wire.protocol.TASKS.get(task)
    if module is None or not _MODULE.match(module):
        raise ValueError(f"not a host task: {task!r} (one of {', '.join(wire.protocol.TASKS)})")
    embedded = None
    if bundle_zip is not None:
        raw = base64.b64encode(bundle_zip).decode("ascii")
        embedded = [raw[i:i + 76] for i in range(0, len(raw), 76)]
    return render("entry.py.j2", task=task, module=module, params_b64=b64_json(params),
                  bundle_lines=embedded, rendered_by=f"specops {__version__}", protocol=wire.protocol)


def heredoc_delimiter(script: str) -> str:
    """A delimiter that occurs nowhere in ``script`` (so no line of it can end the heredoc)."""
    while True:
        delim = f"SPECOPS_EOF_{secrets.token_hex(8)}"
        if delim not in script:
            return delim


def heredoc_command(command: str, script: str) -> str:
    """``command <<'DELIM'`` followed by ``script`` verbatim and the delimiter line.

    The quoted delimiter turns off every expansion in the body, so the host receives
    exactly ``script`` on stdin.
    """
    if not script.endswith("\n"):
        script += "\n"
    delim = heredoc_delimiter(script)
    return f"{command} <<'{delim}'\n{script}{delim}\n"

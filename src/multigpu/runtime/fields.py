"""A frozen config dataclass as a command line: each field's docstring is its flag's ``--help``
and its default the flag's default, so neither is written twice (torchtitan's job config does
the same). The docstring is the string right after the field, as Sphinx reads attribute docs;
it names the default as argparse does, ``%(default)s``, rather than restating the number.

    @dataclass(frozen=True)
    class StudyConfig:
        repeats: int = 1
        \"\"\"rounds of interleaved runs\"\"\"

    add_field(parser, "--repeats", config=StudyConfig, field="repeats", type=int)
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import re
import textwrap
from typing import Any

_MISSING: Any = object()


@functools.cache
def field_docs(config: type) -> dict[str, str]:
    """``{field name: its docstring, on one line}`` for the fields of ``config`` that have one."""
    body = ast.parse(textwrap.dedent(inspect.getsource(config))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
                and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def add_field(parser: argparse.ArgumentParser, *flags: str, config: type, field: str, default: Any = _MISSING,
              values: dict[str, Any] | None = None, **kwargs: Any) -> argparse.Action:
    """``parser.add_argument(*flags, **kwargs)`` with the help and the default of ``config.<field>``;
    ``default`` for a flag whose spelling differs from the field's value (``"1,2"`` for ``(1, 2)``);
    ``values`` fills ``{name}`` in the docstring, for a constant the help quotes (a default directory).
    A field without a default is a required flag (``PlanConfig.lr``: ``--lr`` must be given), or a positional
    (``ReportConfig.results``), which argparse requires by itself."""
    spec = {f.name: f for f in dataclasses.fields(config)}[field]
    if default is _MISSING:
        if spec.default is dataclasses.MISSING and spec.default_factory is dataclasses.MISSING:
            default = None  # argparse's own for an argument not given; required, it never shows
            if all(flag.startswith("-") for flag in flags):  # argparse refuses required= on a positional
                kwargs.setdefault("required", True)
        else:
            default = spec.default
    text = field_docs(config)[field]
    if values:
        text = text.format_map(values)
    # argparse formats help with %: a literal one (95 %) is written %% there; %(default)s stays argparse's.
    text = re.sub(r"%(?!\()", "%%", text)
    return parser.add_argument(*flags, default=default, help=text, **kwargs)

"""A script's layout on its command line: the contract that lets tune, verify and study re-lay-out any script.

A script that reads its ``Layout`` with ``mg.layout_from_args()`` takes these flags; the verbs that
measure runs pass them (``layout.flags``), so they can run the user's script in any layout without
knowing its model. ``parse_layouts`` reads the verbs' own spelling of layouts (``"tp=2;dp_shard=2"``).

>>> layout, rest = mg.layout_from_args(["--tp", "2", "--steps", "5"])
>>> layout.tp, rest
(2, ['--steps', '5'])
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Sequence

from ..errors import UsageError
from .layout import BOOL_FLAGS, INT_FLAGS, Layout
from .pp import SCHEDULES

FLAGS = (*INT_FLAGS, *BOOL_FLAGS, "--schedule")
# The spelling of a layout in `--layouts`: the Layout's own names of the fields the flags carry.
FIELDS = {*INT_FLAGS.values(), *BOOL_FLAGS.values(), "schedule"}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse would print usage and exit; the contract is one line
        raise UsageError(f"layout flags: {message}; use e.g. --tp 2 --micro-batch 4 (the flags: {' '.join(FLAGS)})")


def _parser() -> argparse.ArgumentParser:
    # allow_abbrev=False: the script's own flags (--steps, --seed) must never be read as an abbreviation of ours
    p = _Parser(add_help=False, allow_abbrev=False)
    for flag in (*INT_FLAGS, "--schedule"):
        p.add_argument(flag, default=None)
    for flag in BOOL_FLAGS:
        p.add_argument(flag, action="store_true", default=None)
    return p


def _positive(flag: str, text: str, fix: str = "") -> int:
    if not (text.isdigit() and int(text) >= 1):
        raise UsageError(f"{flag} takes a positive integer, got {text!r}; {fix or f'use e.g. {flag} 2'}")
    return int(text)


def layout_from_args(argv: Sequence[str] | None = None, default: Layout | None = None) -> tuple[Layout, list[str]]:
    """(the ``Layout`` the command line asks for, the arguments that are not layout flags).

    Reads ``--tp --pp --dp-replicate --dp-shard --ep --cp --micro-batch --activation-checkpointing
    --checkpoint-blocks --schedule --stages-per-rank --compile --sequence-parallel --zero1`` from ``argv`` (default ``sys.argv[1:]``); what a flag leaves out is ``default``'s (a
    script's own defaults, e.g. ``Layout(micro_batch=2)``). The rest goes to the script's own parser.
    A bad value, or a layout multigpu does not build yet (``Layout.unbuilt``: the script would spread by it), is
    a one-line ``UsageError`` (``mg.init`` reports it and exits with status 2).
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    ns, rest = _parser().parse_known_args(argv)
    values = {}
    for flag, field in INT_FLAGS.items():
        text = getattr(ns, field)
        if text is not None:
            values[field] = _positive(flag, text)
    for flag, field in BOOL_FLAGS.items():
        if getattr(ns, field):
            values[field] = True
    if ns.schedule is not None:
        if ns.schedule not in SCHEDULES:
            raise UsageError(f"--schedule takes one of {', '.join(SCHEDULES)}, got {ns.schedule!r}; use e.g. --schedule 1f1b")
        values["schedule"] = ns.schedule
    return dataclasses.replace(default or Layout(), **values).built(), rest


def parse_layouts(text: str, flag: str = "--layouts") -> list[Layout]:
    """``"tp=2;dp_shard=2,tp=2"``: layouts separated by ``;``, each field=value separated by ``,``. A
    degree left out is 1 (dp_shard too: the layout's product is its world size)."""
    layouts = []
    example = f'use e.g. {flag} "tp=2;dp_shard=2;dp_shard=2,tp=2"'
    for item in (part.strip() for part in text.split(";")):
        if not item:
            continue
        values: dict = {"dp_shard": 1}
        for pair in (p.strip() for p in item.split(",") if p.strip()):
            name, eq, value = pair.partition("=")
            name = name.strip().replace("-", "_")
            if not eq or name not in FIELDS:
                raise UsageError(f"{flag} takes field=value pairs of {', '.join(sorted(FIELDS))}, got {pair!r}; {example}")
            value = value.strip()
            if name in BOOL_FLAGS.values():
                if value not in ("0", "1", "true", "false"):
                    raise UsageError(f"{flag}: {name} takes true or false, got {value!r}; e.g. {name}=true")
                values[name] = value in ("1", "true")
            elif name == "schedule":
                values[name] = value
            else:
                values[name] = _positive(f"{flag} {name}", value, f"use e.g. {flag} \"{name}=2\"")
        layouts.append(Layout(**values))
    if not layouts:
        raise UsageError(f"{flag} names no layout, got {text!r}; {example}")
    return layouts


def refuse_fixed(args, who: str, fix: str, extra: tuple[str, ...] = ()) -> None:
    """A verb that sets a script's layout flags (and ``extra``) refuses them on the script's own command line:
    the script would read the last of two, the verb's, silently over the user's."""
    fixed = sorted({a.split("=", 1)[0] for a in args} & {*FLAGS, *extra})
    if fixed:
        raise UsageError(f"{who} {', '.join(fixed)} itself; drop {'them' if len(fixed) > 1 else 'it'} {fix}")


def distinct(layouts: list[Layout], text: str, flag: str = "--layouts") -> list[Layout]:
    """``layouts``, refused in one line when one is named twice, is one process (always run as the baseline) or is
    one multigpu does not build yet (``Layout.unbuilt``: the verbs run each)."""
    for layout in layouts:
        layout.built()
    labels = [layout.label for layout in layouts]
    if "one process" in labels or len(set(labels)) < len(labels):
        raise UsageError(f"{flag} names a layout twice or one process itself ({text!r}); list each once (one "
                         "process is always run, as the baseline)")
    return layouts

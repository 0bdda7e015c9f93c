"""Every code block of README.md and docs/*.md, run as a reader would run it (Sybil finds them; this runs them).

A reader copies a block and runs it; a block that no longer works is a bug the suite must see (the README's
first command once failed on every fresh clone while every test passed). Sybil (a kept library) parses the
Markdown, skips what says ``<!-- skip: next "why" -->`` with that reason, and hands each block here:

- **python**: run as its own program in the document's work folder: the document's setup so far (its
  ``<!-- invisible-code-block: python -->`` blocks: what the reader brings, their ``Net`` or data) then the
  block. ``<!-- doc: launch -n 4 -->`` before it runs it under ``multigpu run -n 4 --cpu``; ``<!-- doc: file
  train.py -->`` also keeps it as that file for the commands below it.
- **shell** (``bash`` blocks, and unlabelled blocks whose lines start with ``$ ``): each command runs in the
  work folder and must end as the doc shows (exit 2 where it shows ``error:``, else the ``exit N`` it
  prints, else 0); every output line the doc shows under a ``$`` command must come out in the same shape:
  the same words in the same order, any token with a digit in it (figures, times, paths) matching any such
  token, a ``...`` token any tokens, and a last token ending in ``...`` any end of the line.
  ``<!-- doc: sub "from" "to" -->`` shrinks a command by flags (it must match the doc's text), and
  ``<!-- doc: omit "text" "why" -->`` shows a command without running it (it needs two hosts,
  a GPU, or the reader's own files), and ``<!-- doc: vary "fragment" -->`` lets a shown line containing the fragment differ (a verdict that
  depends on the machine's speed). A status the doc shows as ``$ echo $?`` and a number under it is the
  command before it's; a command that prints its own (``...; echo "exit $?"``) ends 0 and must print that
  ``exit N`` line as shown. ``<!-- doc: together -->`` starts the block's commands at once (two "nodes" on
  one machine), each checked against its own lines. Tokens that are absolute paths match any path (the work
  folder differs run to run), and this machine's name after ``host`` reads as ``vm``, the docs' machine.
  ``<!-- doc: file train.py --dir runs/a -->``: the block's own run gets the words after the name as its
  arguments (the commands below give it theirs). ``<!-- doc: demo -->``: the block's commands are the
  Makefile's ``demo`` recipe, line for line; where .ci/run ran ``make demo`` before the tests
  (``MULTIGPU_DEMO_LOG`` names its output), that output is checked against the block instead of running the
  same minutes of studies twice.

Unlabelled blocks with no ``$`` are listings (a folder, a table, a synopsis): shown, not run.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from sybil import Sybil
from sybil.parsers.markdown import SkipParser
from sybil.parsers.markdown.lexers import DirectiveInHTMLCommentLexer, FencedCodeBlockLexer

ROOT = Path(__file__).resolve().parent.parent
LINKED = ("examples", "tests", "benchmarks", "src")  # what the docs' commands name, seen from the work folder
TIMEOUT = 600


def _env() -> dict:
    env = dict(os.environ)
    bin_dir = str(Path(sys.executable).parent)  # the venv's multigpu and python first
    env["PATH"] = bin_dir + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests"), env.get("PYTHONPATH", "")])
    env.pop("MULTIGPU_ZOO", None)
    return env


def setup(namespace: dict) -> None:
    work = Path(tempfile.mkdtemp(prefix="mg-doc-"))
    for name in LINKED:
        (work / name).symlink_to(ROOT / name)
    namespace.update(_work=work, _setup=[], _next={})


def teardown(namespace: dict) -> None:
    shutil.rmtree(namespace["_work"], ignore_errors=True)


def _options(example) -> dict:
    options, example.namespace["_next"] = example.namespace["_next"], {}
    return options


def directive(example) -> None:
    """``<!-- doc: launch -n 4 -->``, ``file NAME [ARGS]``, ``sub "from" "to"``, ``omit "text" "why"``, ``vary
    "fragment"``, ``timeout S``, ``together``: for the next block."""
    words = shlex.split(example.parsed)
    nxt = example.namespace["_next"]
    if words[0] == "launch":
        nxt["launch"] = words[1:]
    elif words[0] == "file":  # file NAME [ARGS...]: keep the block as NAME; its own run gets ARGS
        nxt["file"] = words[1]
        nxt["args"] = words[2:]
    elif words[0] == "sub":
        nxt.setdefault("sub", []).append((words[1], words[2]))
    elif words[0] == "omit":  # omit "text" "why": a command holding the text is shown, not run (why is required)
        nxt.setdefault("omit", []).append((words[1], words[2]))
    elif words[0] == "vary":
        nxt.setdefault("vary", []).append(words[1])
    elif words[0] == "timeout":
        nxt["timeout"] = int(words[1])
    elif words[0] == "together":  # the block's commands start at once (two "nodes" of one job on this machine)
        nxt["together"] = True
    elif words[0] == "demo":
        nxt["demo"] = True
    else:
        raise ValueError(f"unknown doc directive {example.parsed!r}; expected launch, file, sub, omit, vary, timeout,"
                         " together or demo")


def _run(argv: list[str] | str, work: Path, timeout: int, shell: bool = False) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(argv, cwd=work, env=_env(), capture_output=True, text=True, timeout=timeout,
                              shell=shell, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as err:
        raise AssertionError(f"{argv!r} ran past {timeout} s; shrink it with <!-- doc: sub ... -->:\n"
                             f"{(err.stdout or b'')[-3000:]!r}") from None


def python_block(example) -> None:
    options = _options(example)
    source = textwrap.dedent(example.parsed)
    source = _substituted(source, options)
    ns = example.namespace
    if example.region.lexemes.get("invisible"):
        ns["_setup"].append(source)
        return
    work: Path = ns["_work"]
    program = "\n".join([*ns["_setup"], source])
    name = options.get("file") or f"block_{example.line}.py"
    (work / name).write_text(program)
    argv = ([sys.executable, "-m", "multigpu", "run", *options["launch"], "--cpu", name] if "launch" in options
            else [sys.executable, name]) + options.get("args", [])
    done = _run(argv, work, options.get("timeout", TIMEOUT))
    assert done.returncode == 0, f"{' '.join(argv)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"


def _substituted(text: str, options: dict) -> str:
    for old, new in options.get("sub", []):
        assert old in text, f"<!-- doc: sub {old!r} ... --> matches nothing in the block below it"
        text = text.replace(old, new)
    return text


PROMPT = re.compile(r"^(?:\w+)?\$ (.*)$")


def _commands(source: str, labelled: bool) -> list[tuple[str, list[str]]]:
    """(command, the output lines the doc shows under it). A bash block's every line that is not a comment is
    a command; an unlabelled block's commands are its ``$ `` lines, the lines up to the next one its output."""
    out: list[tuple[str, list[str]]] = []
    lines = source.replace("\\\n", " ").splitlines()
    for line in lines:
        m = PROMPT.match(line)
        if m:
            out.append((m.group(1), []))
        elif labelled and line.strip() and not line.lstrip().startswith("#"):
            out.append((line, []))
        elif out and line.strip():
            out[-1][1].append(line)
    return out


def _drop_comment(command: str) -> str:
    """The command without a trailing `` # comment`` (a ``#`` inside quotes stays)."""
    for m in re.finditer(r"\s#", command):
        head = command[:m.start()]
        if head.count('"') % 2 == 0 and head.count("'") % 2 == 0:
            return head.rstrip()
    return command


def shape(line: str) -> list[str]:
    """A line's words with every token that holds a digit (a figure, a time, a path with a date) or is an
    absolute path (``/tmp/doc);``, ``"/tmp/doc/train.py",``: the work folder differs run to run) as ``#``."""
    return ["#" if re.search(r"\d", tok) or re.match(r"""^[(\['"`]*/\w""", tok) else tok for tok in line.split()]


def _as_shown(output: str) -> str:
    """The output as the docs show it: this machine's name after ``host`` is ``vm``, the docs' machine."""
    host = socket.gethostname()
    return re.sub(rf"(?<=host ){re.escape(host)}\b", "vm", output) if host and host != "vm" else output


def _fits(want: list[str], got: list[str]) -> bool:
    """``got`` has ``want``'s shape: a last token ending in ``...`` leaves the line's end open, and a ``...``
    token inside the line stands for any tokens (the part of a line that differs as a race goes)."""
    open_end = want[-1].endswith("...")
    parts: list[list[str]] = [[]]
    for tok in want[:-1] if open_end else want:
        if tok == "...":
            parts.append([])
        else:
            parts[-1].append(tok)
    if got[:len(parts[0])] != parts[0]:
        return False
    pos = len(parts[0])
    for i, part in enumerate(parts[1:], 1):
        if i == len(parts) - 1 and not open_end:  # the last part ends the line
            return len(got) - pos >= len(part) and got[len(got) - len(part):] == part
        at = next((j for j in range(pos, len(got) - len(part) + 1) if got[j:j + len(part)] == part), None)
        if at is None:
            return False
        pos = at + len(part)
    return open_end or pos == len(got)


def _shown(expected: str, output_lines: list[list[str]]) -> bool:
    want = shape(expected)
    if not want:
        return True
    return any(_fits(want, got) for got in output_lines)


def _statuses(commands: list[tuple[str, list[str]]]) -> list[tuple[str, list[str], int | None]]:
    """(command, shown lines, the status the doc shows for it by ``$ echo $?`` right after it, else None);
    the ``echo $?`` commands themselves are folded into the one before them."""
    out: list[tuple[str, list[str], int | None]] = []
    for command, shown in commands:
        numbers = [int(s) for s in shown if s.strip().isdigit()]
        if command.strip() == "echo $?" and out and out[-1][2] is None and len(numbers) == 1:
            out[-1] = (out[-1][0], out[-1][1], numbers[0])
        else:
            out.append((command, shown, None))
    return out


def _check(command: str, shown: list[str], status: int | None, code: int, got: str, options: dict) -> None:
    shown = [s for s in shown if s.strip() not in ("...", "")]
    exit_lines = [s.strip() for s in shown if re.match(r"^exit \d+$", s.strip())]
    if "$?" in command:  # it prints its own status (`...; echo "exit $?"`): that line, exactly as shown
        want_exit = 0
        for line in exit_lines:
            assert line in [g.strip() for g in got.splitlines()], f"`{command}` did not print `{line}`:\n{got[-4000:]}"
    elif status is not None:
        want_exit = status
    else:
        want_exit = next((int(s.split()[1]) for s in exit_lines), 2 if any(": error:" in s for s in shown) else 0)
    assert code == want_exit, f"`{command}` exited {code}, the doc shows {want_exit}:\n{got[-4000:]}"
    got = _as_shown(got)
    lines = [shape(line) for line in got.splitlines()]
    for line in shown:
        if re.match(r"^exit \d+$", line.strip()) or any(v in line for v in options.get("vary", [])):
            continue
        assert _shown(line, lines), f"`{command}` did not print a line shaped as the doc's:\n  {line}\ngot:\n{got[-4000:]}"


def shell_block(example) -> None:
    options = _options(example)
    labelled = example.region.lexemes["arguments"] == "bash"
    commands = _commands(example.parsed, labelled)
    if not commands:
        return
    work: Path = example.namespace["_work"]
    _substituted(example.parsed, {"sub": options.get("sub", []) + [(o, "") for o, _ in options.get("omit", [])]})
    runs = []
    for command, shown, status in _statuses(commands):
        if any(text in command for text, _ in options.get("omit", [])):
            continue
        command = _drop_comment(command) if labelled or not shown else command
        for old, new in options.get("sub", []):
            command = command.replace(old, new)
        runs.append((command, shown, status))
    timeout = options.get("timeout", TIMEOUT)
    if options.get("demo"):
        _demo(runs, options, work)
        return
    if options.get("together"):
        procs = [subprocess.Popen(command, cwd=work, env=_env(), shell=True, text=True, stdin=subprocess.DEVNULL,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
                 for command, _, _ in runs]
        try:
            outs = [proc.communicate(timeout=timeout) for proc in procs]
        except subprocess.TimeoutExpired:
            for proc in procs:
                if proc.poll() is None:
                    os.killpg(proc.pid, 9)
            raise AssertionError(f"{[c for c, _, _ in runs]!r} ran past {timeout} s together") from None
        for (command, shown, status), proc, (out, err) in zip(runs, procs, outs):
            _check(command, shown, status, proc.returncode, out + err, options)
        return
    for command, shown, status in runs:
        done = _run(command, work, timeout, shell=True)
        _check(command, shown, status, done.returncode, done.stdout + done.stderr, options)


def _demo_recipe() -> list[str]:
    """The Makefile's ``demo`` recipe, each line as a reader types it (without ``$(VENV)/bin/``)."""
    lines = (ROOT / "Makefile").read_text().split("\ndemo:", 1)[1].split("\n")[1:]
    recipe = []
    for line in lines:
        if not line.startswith("\t"):
            break
        recipe.append(line.strip().replace("$(VENV)/bin/", ""))
    return recipe


def _demo(runs: list[tuple[str, list[str], int | None]], options: dict, work: Path) -> None:
    """A block that is ``make demo``: the same commands as the Makefile's recipe; each command's shown lines
    checked against the output .ci/run's ``make demo`` wrote (make echoes each recipe line before its output),
    or against a run of the command here when there is none."""
    assert [command for command, _, _ in runs] == _demo_recipe(), \
        f"<!-- doc: demo -->: the block's commands {[c for c, _, _ in runs]} are not the Makefile's demo recipe {_demo_recipe()}"
    log = os.environ.get("MULTIGPU_DEMO_LOG")
    if not log:
        for command, shown, status in runs:
            done = _run(command, work, options.get("timeout", TIMEOUT), shell=True)
            _check(command, shown, status, done.returncode, done.stdout + done.stderr, options)
        return
    text = Path(log).read_text()  # .ci/run keeps it only when make demo ended 0
    echoed = [re.search(rf"^\S*{re.escape(command)}$", text, re.M) for command, _, _ in runs]
    assert all(echoed), f"{log} does not hold every demo command's echo: {[c for c, _, _ in runs]}"
    ends = [m.start() for m in echoed[1:]] + [len(text)]
    for (command, shown, status), start, end in zip(runs, echoed, ends):
        _check(command, shown, status, 0, text[start.end():end], options)


class _Directives:
    def __call__(self, document):
        for region in DirectiveInHTMLCommentLexer("doc", arguments=".+?")(document):
            region.parsed = region.lexemes["arguments"]
            region.evaluator = directive
            yield region


class _Blocks:
    """Fenced python/bash/unlabelled blocks and invisible python setup blocks, each with its evaluator."""

    def __call__(self, document):
        for region in FencedCodeBlockLexer(language=r"[\w-]*")(document):
            language = region.lexemes["language"]
            region.parsed = region.lexemes["source"]
            region.lexemes["arguments"] = language
            if language == "python":
                region.evaluator = python_block
            elif language in ("bash", ""):
                region.evaluator = shell_block
            else:
                continue  # json, text: data shown, nothing to run
            yield region
        for region in DirectiveInHTMLCommentLexer("invisible-code-block", arguments="python")(document):
            region.parsed = region.lexemes["source"]
            region.lexemes["invisible"] = True
            region.evaluator = python_block
            yield region


def sybil() -> Sybil:
    return Sybil(parsers=[_Directives(), _Blocks(), SkipParser()], patterns=["README.md", "docs/*.md"], path=str(ROOT),
                 setup=setup, teardown=teardown)


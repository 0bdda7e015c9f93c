"""The house rules, checked: small modules, imports that go one way, a CLI whose flags are decisions.

A failure here is not a bug in the code but a change to the shape of the
project: split the module, break the cycle, or add the new flag to FLAGS
below in the same commit that adds it to the CLI (torchtitan freezes its
config the same way).
"""

from __future__ import annotations

import argparse
import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
MAX_LINES = 400

# Every verb's flags. A new flag is a decision: add it here, and to the docs.
FLAGS = {
    "bench": ["--backend", "--bucket-cap-mb", "--ddp", "--dtype", "--group-size", "--iters", "--json", "--no-check",
              "--nproc", "--ops", "--sizes", "--timeout", "--warmup", "-n",
              # --precision: training steps in two precisions (commbench/precision.py)
              "--batch", "--compile", "--fp8-exclude", "--fp8-include", "--fp8-recipe", "--model", "--precision",
              "--rounds", "--seq-len"],
    "ckpt": [],
    "ckpt export": ["--hf", "<checkpoint>", "<out>"],
    "ckpt import": ["<hf_dir>", "<out>"],
    "ckpt ls": ["<dir>"],
    "ckpt verify": ["<dir>"],
    "doctor": ["--backend", "--json", "--no-smoke", "--nproc", "--port", "--timeout", "-n"],
    "forecast": ["--async-tp", "--async-tp-overlap", "--compile", "--compile-loss", "--dp-overlap", "--efficiency",
                 "--expert-imbalance", "--fp8-all-gather", "--fp8-tp-all-gather", "--grad-sync", "--logits-held",
                 "--loss-parallel",
                 "--fp8-exclude", "--fp8-include", "--fp8-recipe",
                 "--global-batch", "--gpu",
                 "--gpus", "--gpus-per-node", "--hbm-gib", "--json", "--layout", "--micro-batches", "--model", "--out",
                 "--peak-tflops",
                 "--precision", "--runtime-gib", "--scale-out-gb-s", "--scale-up-gb-s", "--script", "--seq-len", "--top"],
    "plan": ["--batch", "--checkpoint-every", "--eval-every", "--gpus", "--lr", "--noise-scale", "--optimizer",
             "--per-gpu-batch", "--policy", "--steps", "--warmup-steps"],
    "report": ["--output", "-o", "<results>"],
    "run": ["--all-ranks", "--allow-no-group", "--cpu", "--fault-tolerant", "--find-batch", "--hang-timeout", "--lighthouse",
            "--log-dir", "--master", "--max-restarts",
            "--memory-budget", "--nnodes", "--node-rank", "--node-timeout", "--nproc", "--profile", "--rdzv-last-call", "--rdzv-timeout",
            "-m", "-n", "<script>",
            "<script_args>"],
    "tune": ["--context", "--cpu", "--experts", "--memory-budget", "--micro-batches", "--model", "--nproc", "--out", "--repeats", "--seq-len", "--steps", "--threads",
             "--top", "-n", "<args>", "<workload>"],
    "verify": ["--cpu", "--global-batch", "--layouts", "--out", "--rtol", "--steps", "--workers", "-m", "<args>", "<target>"],
    "study": ["--budget", "--ci", "--cpu", "--global-batch", "--layouts", "--max-repeats", "--no-report", "--out", "--policy",
              "--profile", "--repeats", "--steps", "--target", "--threads", "--workers", "<workload>"],
}


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for f in sorted(SRC.rglob("*.py")):
        parts = list(f.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = f
    return mods


def _imports(mods: dict[str, pathlib.Path]) -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in its body (inside functions too)."""

    def resolve(name: str, f: pathlib.Path, level: int, mod: str) -> str:
        if level:
            base = mod.split(".") if f.name == "__init__.py" else mod.split(".")[:-1]
            base = base[: len(base) - (level - 1)]
            name = ".".join(base + ([name] if name else []))
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name

    edges: dict[str, set[str]] = {m: set() for m in mods}
    for mod, f in mods.items():
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets = [(a.name, 0) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                prefix = node.module + "." if node.module else ""
                targets = [(node.module or "", node.level)] + [(prefix + a.name, node.level) for a in node.names]
            else:
                continue
            for name, level in targets:
                target = resolve(name, f, level, mod)
                # A module importing its own package's __init__ (or a parent's) is not a cycle.
                if target and target != mod and not mod.startswith(target + "."):
                    edges[mod].add(target)
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_module_in_src_passes_the_line_limit():
    big = {m: n for m, f in _modules().items() if (n := len(f.read_text().splitlines())) > MAX_LINES}
    assert not big, f"modules over {MAX_LINES} lines (split each into a small package): {big}"


def test_src_has_no_import_cycle():
    assert _cycles(_imports(_modules())) == []


# The layers, bottom up (docs/architecture.md): a module imports its own layer and the ones below.
LAYERS = [
    ("runtime", ["errors", "values", "compat", "dist", "fingerprint", "runtime"]),
    ("loop pieces", ["batch", "data", "loss", "spreads"]),
    ("parallelism", ["parallel", "precision"]),  # precision converts a model's layers (float8)
    ("instruments and state", ["meter", "noise", "checkpoint", "finder", "pretrained"]),
    # The tools, in four layers of their own: what they are built from (the launcher, the page writer, the
    # recipes), what measures or models a run (study, forecast, the collective benchmarks), what decides
    # (tune weighs forecast and measurement, verify and doctor judge), and the commands over all of them.
    ("tool parts", ["launch", "report", "recipes", "verify_floor", "testing"]),
    ("measures and models", ["study", "forecast", "commbench"]),
    ("decisions", ["tune", "verify", "doctor", "planner"]),
    ("commands", ["cli", "__main__"]),
]


def _layer(mod: str) -> int:
    """The layer of a module: its longest matching prefix in LAYERS."""
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            name = f"multigpu.{prefix}"
            if (mod == name or mod.startswith(name + ".")) and len(name) > depth:
                best, depth = i, len(name)
    assert best is not None, f"{mod} is in no layer: add it to LAYERS and docs/architecture.md"
    return best


def test_imports_go_down_the_layers():
    upward = []
    for mod, targets in _imports(_modules()).items():
        if mod == "multigpu":
            continue  # the package's __init__ is the public API over every layer
        for target in targets:
            # "multigpu" itself: `from .. import __version__`, the one name read from the package.
            if target != "multigpu" and _layer(target) > _layer(mod):
                upward.append(f"{mod} ({LAYERS[_layer(mod)][0]}) imports {target} ({LAYERS[_layer(target)][0]})")
    assert not upward, "imports that go up a layer: " + "; ".join(sorted(upward))


def test_the_layer_of_a_module_is_its_longest_prefix():
    assert _layer("multigpu.runtime.contract") == 0 and _layer("multigpu.launch.start") == 4
    assert _layer("multigpu.parallel.fsdp") == 2 and _layer("multigpu.checkpoint") == 3


def test_the_cycle_check_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def _verb_flags() -> dict[str, list[str]]:
    """'verb' (or 'verb subverb') -> its flags and positionals, help excluded."""
    from multigpu.cli import build_parser

    flags: dict[str, list[str]] = {}

    def walk(name: str, p: argparse.ArgumentParser) -> None:
        names = []
        for a in p._actions:  # argparse keeps no public list of a parser's actions
            if isinstance(a, argparse._SubParsersAction):
                for sub, sp in a.choices.items():
                    walk(f"{name} {sub}".strip(), sp)
            elif a.option_strings:
                names += [s for s in a.option_strings if s not in ("-h", "--help")]
            else:
                names.append(f"<{a.dest}>")
        if name:
            flags[name] = sorted(names)

    walk("", build_parser())
    return flags


def test_every_verb_flag_is_a_decision():
    got = _verb_flags()
    assert sorted(got) == sorted(FLAGS), "verbs changed: update FLAGS"
    for verb, names in got.items():
        added, removed = sorted(set(names) - set(FLAGS[verb])), sorted(set(FLAGS[verb]) - set(names))
        assert not added and not removed, f"multigpu {verb}: flags added {added}, removed {removed}; update FLAGS and the docs"

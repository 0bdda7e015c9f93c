"""`multigpu bench --precision bf16,fp8`: training steps of one model in two precisions, rounds interleaved, the
speedup per round with its median and range, float8's layers, and a verdict drawn only where every round agrees
(docs/float8.md)."""

from __future__ import annotations

import json
import statistics
import time

import pytest
import torch

from multigpu.cli import main
from multigpu.commbench.precision import verdict

TINY = ["bench", "--model", "tiny", "--seq-len", "32", "--batch", "2", "--iters", "2", "--warmup", "1"]


def bench(argv: list[str], capsys) -> tuple[int, str, str]:
    """``multigpu *argv`` in this process: (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    out = capsys.readouterr()
    return code, out.out, out.err


def test_rounds_interleaved_and_their_figures_agree_with_the_wall_clock(capsys):
    pytest.importorskip("torchao.float8")
    start = time.perf_counter()
    code, printed, err = bench(TINY + ["--precision", "bf16,fp8", "--rounds", "3", "--fp8-include", "blocks", "--json"],
                               capsys)
    wall = time.perf_counter() - start
    assert code == 0, err
    out = json.loads(printed)
    rates = out["tokens_per_s"]
    assert list(rates) == ["bf16", "fp8"] and all(len(r) == 3 and min(r) > 0 for r in rates.values())
    assert out["speedups"] == pytest.approx([f / b for b, f in zip(rates["bf16"], rates["fp8"])], rel=1e-12)
    assert out["median"] == pytest.approx(statistics.median(out["speedups"]), rel=1e-12)
    # The timed steps happened inside this call: their time, from the rates, is less than its wall clock.
    timed = sum(out["tokens_per_step"] * out["steps_per_round"] / r for rs in rates.values() for r in rs)
    assert 0 < timed < wall
    assert out["float8"].startswith("mg.Precision('fp8'): 12 of 13 Linear layers in float8 (tensorwise, emulated")
    assert "head (tied weight)" in out["float8"]
    assert out["verdict"].startswith("not measurable here: float8 is emulated on the CPU")


def test_verdict_only_where_every_round_agrees():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert verdict("bf16", "fp8", [1.2, 1.3, 1.25], gpu, True) == "fp8 faster than bf16 in every round"
    assert verdict("bf16", "fp8", [0.9, 0.8, 0.95], gpu, False).endswith("no torch.compile, so the casts to float8 "
                                                                        "run as kernels of their own (add --compile)")
    assert "too small or too few" in verdict("bf16", "fp8", [0.9, 0.8, 0.95], gpu, True)
    assert verdict("bf16", "fp8", [1.1, 0.97, 1.2], gpu, True).startswith("no difference the 3 rounds can tell apart")
    assert verdict("bf16", "fp8", [3.0, 3.0], cpu, True).startswith("not measurable here")  # emulated, whatever it says
    assert verdict("fp32", "bf16", [1.5, 1.6], cpu, False) == "bf16 faster than fp32 in every round"  # CPU is judged
    assert verdict("fp32", "bf16", [0.5, 0.6], cpu, False) == "bf16 slower than fp32 in every round"


@pytest.mark.parametrize("extra, says", [
    (["--precision", "fp8"], "--precision takes two different precisions, the baseline first"),
    (["--precision", "bf16,bf16"], "--precision takes two different precisions"),
    (["--precision", "bf16,fp4"], "--precision takes two different precisions"),
    (["--precision", "bf16,fp8", "--ops", "all_reduce"], "--ops time collectives"),
    (["--precision", "bf16,fp8", "--rounds", "1", "--fp8-include", "blocks"], "--rounds must be at least 2 (one round"),
    (["--precision", "fp32,bf16", "--fp8-include", "blocks"], "add fp8 or leave them out"),
    (["--precision", "bf16,fp8", "--dtype", "float16"], "--dtype time collectives"),
    (["--precision", "bf16,fp8"], "no Linear layer of GPT is converted to float8"),  # tiny's layers are all small
    (["--precision", "bf16,fp8", "--fp8-exclude", "nothing"], "float8 include/exclude name modules GPT does not have"),
])
def test_bad_input_is_one_line(extra, says, capsys):
    if "GPT" in says or "--rounds" in says:  # reached only past torchao's import
        pytest.importorskip("torchao.float8")
    code, _, err = bench(TINY + extra, capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err


def test_a_model_that_does_not_return_logits_is_one_line(tmp_path, capsys, monkeypatch):
    """A model whose forward returns a tuple: one line naming what --precision times, not a traceback."""
    (tmp_path / "pair.py").write_text(
        "import torch\n"
        "class Pair(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.embed, self.head = torch.nn.Embedding(64, 32), torch.nn.Linear(32, 64)\n"
        "    def forward(self, ids):\n"
        "        return self.head(self.embed(ids)), None\n"
        "def build():\n"
        "    return Pair()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    code, _, err = bench(["bench", "--model", "pair:build", "--seq-len", "8", "--batch", "2", "--iters", "1",
                          "--warmup", "1", "--precision", "fp32,bf16"], capsys)
    lines = [line for line in err.splitlines() if "error:" in line]
    assert code == 2 and len(lines) == 1 and "returns logits (batch, seq, vocab) or an output with .logits, got " \
        "tuple" in lines[0], err


def test_the_fp8_hint_is_in_the_flags_words(capsys):
    pytest.importorskip("torchao.float8")
    code, _, err = bench(TINY + ["--precision", "bf16,fp8"], capsys)
    assert code == 2 and "name the ones to convert anyway: --fp8-include 'blocks.0.mlp.up'" in err, err

"""How far one Layout travels: the files of multigpu that ``mg.parallelize`` and ``mg.parallel.pipeline`` pass
through, as stays (runs of calls in one file) and returns (a stay in a file visited before).

    python benchmarks/layout_walk.py            # 2 gloo ranks on this machine, a tiny transformers Llama

Every Python call event in ``src/multigpu`` is recorded (``sys.setprofile``) while rank 0 spreads the model:
TP 2 through ``mg.parallelize``, then PP 2 through ``mg.parallel.pipeline``. Not a timing: the count of
places a reader follows, the same on any machine for the same code (issue "The house, third pass").
"""

from __future__ import annotations

import json
import os
import sys

import torch

import multigpu as mg
from multigpu.testing import spawn

ROOT = os.path.dirname(os.path.abspath(mg.__file__))


def _walk(fn) -> dict:
    files: list[str] = []

    def profile(frame, event, arg):
        if event == "call":
            f = frame.f_code.co_filename
            if f.startswith(ROOT) and (not files or files[-1] != f):
                files.append(f)

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    names = [os.path.relpath(f, ROOT) for f in files]
    seen: set[str] = set()
    returns = 0
    for n in names:
        returns += n in seen
        seen.add(n)
    return {"files": len(seen), "stays": len(names), "returns": returns, "path": names}


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).double()


def _worker(dist) -> dict:
    import torch.nn.functional as F

    def loss_fn(logits, y):
        return F.cross_entropy(logits.flatten(0, 1), y.flatten())

    out = {}
    tp = mg.parallel.Layout(tp=2)
    out["mg.parallelize (TP 2)"] = _walk(lambda: mg.parallelize(_llama(), tp, verbose=False))
    pp = mg.parallel.Layout(pp=2, micro_batch=2)
    plan = pp.plan(8, dist)
    out["mg.parallel.pipeline (PP 2)"] = _walk(lambda: mg.parallel.pipeline(_llama(), pp, loss_fn, plan,
                                                                            verbose=False))
    return out


if __name__ == "__main__":
    result = spawn(_worker, 2, timeout=300)[0]
    for name, r in result.items():
        print(f"{name}: {r['files']} files, {r['stays']} stays, {r['returns']} returns")
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))

"""Memory and time of loading a Hugging Face checkpoint onto a layout (docs/pretrained.md, issue "Start
from a published checkpoint").

A Llama of about 1.2 GB in float32 (4 layers, hidden 2,048, vocabulary 32,000: built from a config and
saved by transformers' own save_pretrained in 1 GB shards, no download) is loaded on 4 CPU ranks three
ways, interleaved (A B C, repeated): transformers' from_pretrained in every process (the only start before
mg.from_pretrained), mg.from_pretrained onto FSDP 4, and onto TP 2 x FSDP 2. Per rank: the resident
memory before the load (the interpreter with torch and transformers imported) and its peak during the
load (the kernel's high-water mark, VmHWM, reset before the load) until every weight has been written once
(as the first optimizer step writes it: transformers on CPU leaves weights memory-mapped from the files
until then, pages the kernel shares), and the load's wall time; against
the bound 1.25 x (model bytes / the model-parallel ways + the largest tensor), and the time against
reading every tensor of the files in one process (safetensors' load_file; the files warm in the page
cache for every variant, read once before: the ratio is the load's work beyond the bytes).

    python benchmarks/pretrained_load.py [--repeats 2] [--dir /tmp/mg-pretrained-bench]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def make(directory: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (directory / "config.json").is_file():
        return
    config = LlamaConfig(vocab_size=32_000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=4,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory, max_shard_size="1GB")


def _rss(field: str) -> float:
    """This process's resident memory (VmRSS) or its high-water mark (VmHWM), MiB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _reset_peak() -> None:
    """Reset VmHWM to the current resident size (Linux: write 5 to clear_refs)."""
    Path("/proc/self/clear_refs").write_text("5")


class _Sampler:
    """The peak of this process's anonymous resident memory (RssAnon: its own allocations, the part that is
    the model's shards and the load's buffers) every 2 ms on a thread; VmHWM adds the file pages a memory map
    touched, which are the page cache the ranks share."""

    def __init__(self) -> None:
        import threading

        self.peak, self._stop = _rss("RssAnon"), threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            self.peak = max(self.peak, _rss("RssAnon"))

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, _rss("RssAnon"))


def load(dist, directory: str, how: str) -> dict:
    import multigpu as mg
    from transformers import AutoModelForCausalLM

    layouts = {"fsdp4": mg.parallel.Layout(dp_shard=4), "tp2xfsdp2": mg.parallel.Layout(tp=2, dp_shard=2)}
    torch.distributed.barrier()
    before, before_anon = _rss("VmRSS"), _rss("RssAnon")
    _reset_peak()
    sampler = _Sampler()
    start = time.perf_counter()
    if how == "hf-every-rank":
        model = AutoModelForCausalLM.from_pretrained(directory)
    else:
        model = mg.from_pretrained(directory, layouts[how], verbose=False)
    with torch.no_grad():  # as the first optimizer step does: every weight written (a memory-mapped one copied)
        for p in model.parameters():
            (p.to_local() if hasattr(p, "to_local") else p).mul_(1)
    seconds = time.perf_counter() - start
    peak, peak_anon = _rss("VmHWM"), sampler.stop()
    torch.distributed.barrier()
    del model
    return {"before_mib": before, "peak_mib": peak, "before_anon_mib": before_anon, "peak_anon_mib": peak_anon,
            "seconds": seconds}


def raw_read(directory: Path) -> float:
    """Seconds to read every byte of the safetensors files into memory, in one process."""
    start = time.perf_counter()
    for f in sorted(directory.glob("*.safetensors")):
        f.read_bytes()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--dir", default="/tmp/mg-pretrained-bench")
    args = ap.parse_args()
    from safetensors import safe_open

    from multigpu.runtime.fingerprint import fingerprint
    from multigpu.testing import spawn

    directory = Path(args.dir)
    make(directory)
    sizes = []
    for f in directory.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as g:
            for k in g.keys():
                shape = g.get_slice(k).get_shape()
                sizes.append(4 * (1 if not shape else __import__("math").prod(shape)))
    model_mib, largest_mib = sum(sizes) / 2 ** 20, max(sizes) / 2 ** 20
    raw_read(directory)  # the page cache warm for every variant
    raws = [raw_read(directory) for _ in range(3)]
    rows: dict[str, list[dict]] = {}
    for _ in range(args.repeats):
        for how in ("hf-every-rank", "fsdp4", "tp2xfsdp2"):
            out = spawn(load, 4, str(directory), how, timeout=1200)
            rows.setdefault(how, []).extend(out)
    bound = 1.25 * (model_mib / 4 + largest_mib)
    raw = statistics.median(raws)
    print(f"model {model_mib:,.0f} MiB (largest tensor {largest_mib:,.0f} MiB), 4 CPU ranks; bound for 4 "
          f"model-parallel ways: 1.25 x ({model_mib / 4:,.0f} + {largest_mib:,.0f}) = {bound:,.0f} MiB above the "
          f"process's own; reading the files raw in one process: {raw:.2f} s (median of 3, {min(raws):.2f}-"
          f"{max(raws):.2f})")
    report = {"model_mib": model_mib, "largest_mib": largest_mib, "bound_mib": bound, "raw_read_s": raws,
              "fingerprint": fingerprint(), "rows": rows}
    for how, runs in rows.items():
        own = [r["peak_anon_mib"] - r["before_anon_mib"] for r in runs]
        added = [r["peak_mib"] - r["before_mib"] for r in runs]
        secs = [r["seconds"] for r in runs]
        print(f"{how:14s} per rank, above the process before the load ({statistics.median(r['before_mib'] for r in runs):,.0f} MiB): "
              f"own memory peak max {max(own):,.0f} MiB (min {min(own):,.0f}; {max(own) / bound:.2f} x the bound), "
              f"resident with the mapped files' pages max {max(added):,.0f} MiB; load {statistics.median(secs):.2f} s "
              f"median ({min(secs):.2f}-{max(secs):.2f}), {statistics.median(secs) / raw:.1f} x the raw read")
    (directory / "results.json").write_text(json.dumps(report, indent=1, default=str))
    print(f"environment and every rank's figures: {directory / 'results.json'}")


if __name__ == "__main__":
    main()

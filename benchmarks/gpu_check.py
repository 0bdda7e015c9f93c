"""`make gpu-check`: everything that needs a CUDA GPU, in one run (< 8 min on one GPU).

1. the GPU-marked tests (nccl, CUDA events, NVML, real OOM);
2. the digits demo on the GPU (nccl, world size 1, bf16);
3. the overhead benchmarks on the GPU (1 process, nccl): the training loop (bf16), the step
   meter, NoiseScale (from micro-batches);
4. the GPT recipe at GPT-2 124M on one GPU, bf16 and torch.compile per block: tokens/s, MFU
   (against the GPU's dense bf16 peak) and peak memory, without and with activation checkpointing;
   the first run also saves an async checkpoint every 20 steps (the loop's blocking time per save
   in its "saving ... in the background" lines, the total in "saved ...");
5. `multigpu tune` of GPT-2 124M on the one GPU (micro-batch 4/8/16, activation checkpointing):
   predicted against measured step time and memory;
6. float8 against bf16 (`multigpu bench --precision bf16,fp8`): GPT-2 124M compiled, rounds interleaved, the
   speedup's median and range and a verdict (skipped, and said, where torchao is not installed);
7. the achieved fraction of peak of one decoder block by model, tensor-parallel cut and micro-batch
   (``benchmarks/block_efficiency.py``): the per-shape efficiency the forecast's one number stands for.
Prints each step's exit status and a one-line summary; exits non-zero if any failed.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import time

CKPT = os.path.join(tempfile.gettempdir(), f"mg-gpu-check-ckpt-{os.getpid()}")  # fresh: no resume

STEPS = [
    ("gpu tests", [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests"]),
    ("digits demo, bf16", [sys.executable, "-m", "multigpu", "run", "-n", "1", "-m", "multigpu.recipes.digits",
                           "--precision", "bf16"]),
    ("overhead benchmark", [sys.executable, "benchmarks/overhead.py", "--device", "cuda"]),
    ("meter overhead", [sys.executable, "benchmarks/meter.py", "--device", "cuda", "--trials", "5"]),
    ("noise-scale overhead", [sys.executable, "benchmarks/noise_overhead.py", "--device", "cuda", "--blocks", "20",
                              "--every", "1,4"]),
    *[(f"gpt2 124M, bf16, compile{name}", [sys.executable, "-m", "multigpu", "run", "-n", "1", "-m",
                                           "multigpu.recipes.gpt", "--size", "gpt2", "--precision", "bf16", "--compile",
                                           "--global-batch", "16", "--steps", "60", "--warmup-steps", "5",
                                           "--eval-every", "1000", "--eval-batches", "1", "--log-every", "10", *extra])
      for name, extra in ((", async checkpoint every 20 steps", ["--checkpoint-dir", CKPT, "--checkpoint-every", "20",
                                                                   "--async-checkpoint"]),
                          (", activation checkpointing", ["--activation-checkpointing"]))],
    # One GPU: tune chooses micro-batch and activation checkpointing (fp32: the recipe's default precision).
    ("tune gpt2 124M on one GPU", [sys.executable, "-m", "multigpu", "tune", "-n", "1", "--top", "3", "--repeats", "1",
                                   "--steps", "10", "--micro-batches", "4,8,16", "gpt", "--size", "gpt2",
                                   "--global-batch", "32", "--warmup-steps", "2"]),
    # float8 against bf16, A B A B, compiled per block (torchao's casts fuse only under compile).
    ("fp8 vs bf16 speed, gpt2 124M", [sys.executable, "-m", "multigpu", "bench", "--precision", "bf16,fp8", "--model",
                                      "gpt2", "--compile", "--iters", "10", "--rounds", "4"]),
    # The achieved fraction of peak block by block (forecast's one number per GPU kind, measured by shape).
    ("block efficiency by shape", [sys.executable, "benchmarks/block_efficiency.py", "--rounds", "3"]),
    ("meter + profiler example", [sys.executable, "-m", "multigpu", "run", "-n", "1", "examples/observe.py",
                                  "--steps", "40", "--profile", "10:15", "--log-every", "10"]),
]


def main() -> int:
    import torch

    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU visible; nothing to check here (run it on a GPU machine)")
        return 2
    print(f"gpu-check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = []
    for name, cmd in STEPS:
        if "bf16,fp8" in cmd and importlib.util.find_spec("torchao") is None:  # the fp8 extra, not on every GPU box
            print(f"\n=== {name}: skipped, torchao is not installed in this python (pip install 'multigpu[fp8]')")
            continue
        t0 = time.perf_counter()
        print(f"\n=== {name}: {' '.join(cmd)}", flush=True)
        rc = subprocess.call(cmd)
        print(f"=== {name}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        if rc != 0:
            failed.append(name)
    shutil.rmtree(CKPT, ignore_errors=True)
    print(f"\ngpu-check: {len(STEPS) - len(failed)} passed, {len(failed)} failed" + (f" ({', '.join(failed)})" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

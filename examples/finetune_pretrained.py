"""Fine-tune a published checkpoint on any layout and export one transformers loads (docs/pretrained.md).

    python examples/finetune_pretrained.py --make-base base                      # a small Llama, saved locally
    multigpu run -n 2 --cpu examples/finetune_pretrained.py base tuned --dp-shard 2   # FSDP 2
    multigpu run -n 2 --cpu examples/finetune_pretrained.py base tuned-tp --tp 2      # TP 2

The checkpoint is read onto the layout with ``mg.from_pretrained`` (each rank reads only its shards) and the
tuned model written from it with ``mg.save_pretrained`` (sharded safetensors, config, index), which
``AutoModelForCausalLM.from_pretrained("tuned")`` loads as it is. ``--make-base`` stands in for a download
(this machine has none): a Llama built from a config and saved by transformers' own ``save_pretrained``.
"""

from __future__ import annotations

import argparse
import resource
import time

import torch
import torch.nn.functional as F

import multigpu as mg


def make_base(directory: str) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         bos_token_id=0, eos_token_id=1)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory, max_shard_size="1MB")
    print(f"saved {sum(p.numel() for p in model.parameters()):,} parameters to {directory}")


def main() -> None:
    with mg.init(seed=0) as dist:
        layout, rest = mg.layout_from_args()
        ap = argparse.ArgumentParser()
        ap.add_argument("base")
        ap.add_argument("out")
        ap.add_argument("--steps", type=int, default=10)
        args = ap.parse_args(rest)
        start = time.perf_counter()
        model = mg.from_pretrained(args.base, layout, verbose=False).train()
        loaded = time.perf_counter() - start
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # MiB (Linux reports KiB)
        peaks = [None] * dist.world_size
        torch.distributed.all_gather_object(peaks, peak) if dist.world_size > 1 else peaks.__setitem__(0, peak)
        mg.print0(f"loaded {args.base} onto {layout.resolve(dist.world_size).label} in {loaded:.2f} s; peak memory "
                  f"per rank {max(peaks):.0f} MiB")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        g = torch.Generator().manual_seed(0)  # the same batch on every rank, for brevity (mg.loader splits data: docs/data.md)
        for step in range(args.steps):
            x = torch.randint(0, 256, (4, 33), generator=g).to(dist.device)
            logits = model(input_ids=x[:, :-1]).logits
            if hasattr(logits, "full_tensor"):  # TP leaves the logits sharded over the vocabulary
                logits = logits.full_tensor()
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            mg.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        mg.print0(f"trained {args.steps} steps, loss {loss.item():.3f}")
        mg.save_pretrained(model, args.out)
        mg.print0(f"exported to {args.out}: AutoModelForCausalLM.from_pretrained({args.out!r}) loads it")


if __name__ == "__main__":
    import sys

    if "--make-base" in sys.argv:
        make_base(sys.argv[sys.argv.index("--make-base") + 1])
    else:
        main()

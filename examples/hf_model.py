"""A Hugging Face Llama (built from a config, no download) trained on the GPT recipe's token file, spread by a Layout.

    python examples/hf_model.py                                    # one process
    multigpu run -n 2 --cpu examples/hf_model.py --tp 2            # tensor parallel (the plan the model declares)
    multigpu run -n 4 --cpu examples/hf_model.py --tp 2            # FSDP 2 x TP 2
    multigpu run -n 4 --cpu examples/hf_model.py --dp-replicate 2  # HSDP 2 x 2
    multigpu run -n 2 --cpu examples/hf_model.py --pp 2            # two pipeline stages, 1F1B
    multigpu verify --cpu --layouts "tp=2;dp_shard=2;pp=2" examples/hf_model.py   # each the same as one process?
    multigpu tune -n 4 --cpu examples/hf_model.py                  # which layout is fastest here?
    multigpu run -n 4 --cpu examples/hf_model.py --moe --ep 2      # a Mixtral: EP 2 x FSDP 2 (docs/experts.md)
    multigpu verify --cpu --layouts "dp_shard=2,ep=2;dp_shard=4,ep=2;dp_shard=2,ep=2,tp=2" examples/hf_model.py --moe
    multigpu tune -n 4 --cpu --experts examples/hf_model.py --moe  # the ep layouts weighed too
    multigpu verify --cpu --layouts "cp=2;dp_shard=2,cp=2;cp=2,tp=2" examples/hf_model.py  # long sequences (docs/context.md)

It follows the layout contract (docs/your-model.md): its layout comes from ``mg.layout_from_args()``
(--tp --pp --dp-replicate --dp-shard --ep --micro-batch --activation-checkpointing --schedule --compile), it
takes --steps and --global-batch, and it measures its steps with mg.StepMeter, so tune, verify and
study can run it in any layout. Needs ``pip install multigpu[hf]``. The lines marked ``# +layout`` are
all that differ from one process. ``--moe`` builds a Mixtral of the same sizes instead (4 experts, 2 per
token) whose loss includes its router's load-balancing loss.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F
import transformers

import multigpu as mg
from multigpu.recipes.gpt.data import TokenWindows, prepare_tokens


def model_config(moe: bool = False) -> transformers.PretrainedConfig:
    """The Llama (or, with ``moe``, the Mixtral) this script trains: 64-token sequences of a 256-token vocabulary."""
    sizes = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0, eos_token_id=1,
                 tie_word_embeddings=False)
    if moe:
        return transformers.MixtralConfig(**sizes, num_local_experts=4, num_experts_per_tok=2,
                                          output_router_logits=True, router_aux_loss_coef=0.02)
    return transformers.LlamaConfig(**sizes)


def build_model(moe: bool = False):
    """The model this script trains: `multigpu tune --model examples/hf_model.py:build_model --seq-len 64` counts it
    to predict every layout (docs/tune.md)."""
    return transformers.AutoModelForCausalLM.from_config(model_config(moe))


def main() -> None:
    with mg.init(seed=0) as dist:
        # A mixture of experts' router loss is a micro-batch's: one micro-batch a step (each rank's share
        # whole) makes it the step's on every layout, as on one process (docs/experts.md).
        moe = "--moe" in sys.argv
        layout, rest = mg.layout_from_args(default=mg.parallel.Layout(micro_batch=None if moe else 2))  # +layout
        ap = argparse.ArgumentParser()
        ap.add_argument("--steps", type=int, default=20)
        ap.add_argument("--global-batch", type=int, default=16)
        ap.add_argument("--moe", action="store_true", help="a Mixtral (4 experts, top 2) instead of a Llama")
        args = ap.parse_args(rest)
        data = TokenWindows(prepare_tokens("data/pydoc") / "train.bin", block_size=64, vocab_size=256)
        config = model_config(args.moe)
        torch.manual_seed(0)  # the same full model on every rank; mg.parallelize distributes it
        model = build_model(args.moe).to(dist.device)
        plan = layout.plan(args.global_batch, dist)                                            # +layout

        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        if layout.pp > 1:  # the schedule runs forward and backward: the loop calls it
            model = mg.parallel.pipeline(model, layout, loss_fn, plan)                         # +layout
        else:
            model = mg.parallelize(model, layout)                                              # +layout
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        with mg.StepMeter(dist, plan, log_every=5, model=model) as meter:
            for step, micro_batches in meter.steps(mg.loader(data, plan, dist, seed=0)):
                if layout.pp > 1:
                    loss = model.step(micro_batches)
                    model.clip_grad_norm_(1.0)
                else:
                    loss = 0.0
                    for x, y in mg.accumulate(model, micro_batches):
                        out = model(input_ids=x, use_cache=False)
                        part = loss_fn(out.logits, mg.context_share(model, y))  # +layout (cp: this rank's share)
                        if out.get("aux_loss") is not None:  # the router's loss (over every rank's tokens)
                            part = part + config.router_aux_loss_coef * out.aux_loss
                        part = part / plan.accum_steps
                        part.backward()
                        loss += float(part.detach())
                    mg.clip_grad_norm_(model, 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
                meter.step_end(loss=loss)  # None on the pipeline's ranks without the last stage
                if step + 1 == args.steps:
                    break

if __name__ == "__main__":
    main()

"""PEFT LoRA adapters as people fine-tune: ``peft.get_peft_model`` on a transformers Llama, spread by
``mg.parallelize`` under DDP, FSDP (frozen base, trainable adapters in the same units), TP (LoRA on the
column-wise q/v and the row-wise o/down projections), TP x FSDP and HSDP, trained 4 AdamW steps with clipping at
0.5 in float64: the adapter weights and the losses equal one process's within 1e-9, the optimizer holds
state for the adapters only, and ``mg.save_pretrained`` writes the adapter alone in PEFT's format, which
``PeftModel.from_pretrained(base, directory)`` loads into the trained model's logits (within 1e-12).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import multigpu as mg
from multigpu.testing import spawn

import _hf_layouts as hf

pytest.importorskip("transformers")
pytest.importorskip("peft", reason="the lora extra is not installed (pip install multigpu[lora])")

TOL = 1e-9
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]  # column-wise q, v; row-wise o, down under Llama's plan
# the last: LoRA with biases and a trained copy of the head (modules_to_save), the head column-wise under TP
WITH_HEAD = {"lora_bias": True, "modules_to_save": ["lm_head"]}
LAYOUTS = {2: [{"dp_replicate": 2}, {"dp_shard": 2}, {"tp": 2}, {"tp": 2, "lora": WITH_HEAD}], 4: [{"tp": 2, "dp_shard": 2},
                                                                    {"dp_replicate": 2, "dp_shard": 2}]}


def peft_llama(**lora):
    """The same tiny Llama (seed 0) with the same LoRA adapters (seed 1) on every rank, in float64."""
    from peft import LoraConfig, get_peft_model

    model = hf.build("llama")
    torch.manual_seed(1)
    return get_peft_model(model, LoraConfig(r=4, **({"target_modules": TARGETS, "lora_dropout": 0.0} | lora)))


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(2)
    return [torch.randint(0, hf.VOCAB, (8, 17), generator=g) for _ in range(4)]


def _full(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _train(dist, layouts: list[dict], out: str) -> dict:
    """Each layout: 4 AdamW steps (clip 0.5), each data-parallel rank on its share of the batch; the adapter's
    full weights, the losses and norms, what the optimizer holds, and the export's logits as PEFT loads it."""
    from peft import PeftModel

    results = {}
    probe = torch.randint(0, hf.VOCAB, (2, 16), generator=torch.Generator().manual_seed(3))
    for spec in layouts:
        lora = spec.get("lora", {})
        layout = mg.parallel.Layout(**{k: v for k, v in spec.items() if k != "lora"}).resolve(dist.world_size)
        model = mg.parallelize(peft_llama(**lora), layout, verbose=False)
        opt = mg.optimizer(model, torch.optim.AdamW, lr=1e-2)
        n, i = layout.dp_size, layout.dp_rank(dist.rank)
        losses, norms = [], []
        for batch in _batches():
            x = batch[i * 8 // n:(i + 1) * 8 // n]
            logits = _full(model(input_ids=x[:, :-1], use_cache=False).logits)
            loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
            loss.backward()
            norms.append(float(_full(mg.clip_grad_norm_(model, 0.5))))
            opt.step()
            opt.zero_grad(set_to_none=True)
            mean = loss.detach().clone()
            if dist.world_size > 1:  # TP ranks hold their share's loss alike; the shares are equal
                torch.distributed.all_reduce(mean)
                mean /= dist.world_size
            losses.append(float(mean))
        trainable = {id(p) for p in model.parameters() if p.requires_grad}
        stated = {id(p) for p in opt.state}
        full = mg.full_state_dict(model)
        with torch.no_grad():
            logits = _full(model.eval()(input_ids=probe, use_cache=False).logits)
        target = Path(out) / ("-".join(f"{k}{v}" for k, v in spec.items() if k != "lora") + ("-head" if lora else "")
                              or "one")
        mg.save_pretrained(model, target)
        result = {"losses": losses, "norms": norms, "state_only_adapters": stated == trainable,
                  "trainable": len(trainable), "stated": len(stated)}
        if dist.rank == 0:
            result["adapter"] = own = {k: v for k, v in full.items() if "lora_" in k or "modules_to_save" in k}
            loaded = PeftModel.from_pretrained(hf.build("llama"), str(target)).eval()
            assert sorted(k for k in loaded.state_dict() if k in own) == sorted(own)  # every trained tensor saved
            with torch.no_grad():
                result["loaded_logits"] = float((loaded(input_ids=probe, use_cache=False).logits - logits).abs().max())
            result["loaded_adapter"] = max(float((v - own[k]).abs().max()) for k, v in loaded.state_dict().items()
                                           if k in own)
            result["files"] = sorted(p.name for p in target.iterdir())
        results[str(spec)] = result
    return results


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    out = spawn(_train, 1, [{}, {"lora": WITH_HEAD}], str(tmp_path_factory.mktemp("one")), timeout=300)[0]
    return {"": out["{}"], "head": out[str({"lora": WITH_HEAD})]}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_lora_under_ddp_fsdp_tp_trains_as_one_process_and_saves_the_adapter_peft_loads(one_process, tmp_path, world):
    # 4 targets x 2 layers x (A, B): the base is frozen; with biases 8 more, and the head's copy
    assert one_process[""]["trainable"] == one_process[""]["stated"] == 16
    assert one_process["head"]["trainable"] == one_process["head"]["stated"] == 16 + 8 + 1
    out = spawn(_train, world, LAYOUTS[world], str(tmp_path), timeout=600)
    measured = {}
    for name, got in out[0].items():
        ref = one_process["head" if "lora" in name else ""]
        diff = max(float((v - ref["adapter"][k]).abs().max()) for k, v in got["adapter"].items())
        assert sorted(got["adapter"]) == sorted(ref["adapter"]), name
        measured[name] = f"adapter {diff:.1e}, PEFT's load {got['loaded_logits']:.1e}"
        assert diff < TOL, (name, diff)
        assert got["files"] == ["README.md", "adapter_config.json", "adapter_model.safetensors"], (name, got["files"])
        assert got["loaded_adapter"] == 0.0, name  # PEFT reads back the very tensors trained
        assert got["loaded_logits"] < 1e-12, (name, got["loaded_logits"])
    for rank in out:
        for name, got in rank.items():
            ref = one_process["head" if "lora" in name else ""]
            assert max(abs(a - b) for a, b in zip(got["losses"], ref["losses"])) < TOL, name
            assert got["norms"] == pytest.approx(ref["norms"], rel=TOL, abs=0), name
            assert got["state_only_adapters"] and got["stated"] == ref["stated"], name  # none for the frozen base
    print("max difference from one process, and of the logits PeftModel.from_pretrained gives:", measured)


def _refusals(dist, saved: str) -> dict:
    from peft import LoHaConfig, LoraConfig, get_peft_model

    out = {}
    for spec in ({"tp": 2}, {"dp_shard": 2}):  # adapters added after the model was spread: refused, not wrong
        model = get_peft_model(mg.from_pretrained(saved, mg.parallel.Layout(**spec), verbose=False),
                               LoraConfig(r=4, target_modules=TARGETS, lora_dropout=0.0))
        try:
            mg.optimizer(model, torch.optim.AdamW, lr=1e-3)
            out[f"spread first {spec}"] = "not refused"
        except mg.UsageError as e:
            out[f"spread first {spec}"] = str(e)
    for label, build in {"dropout": lambda: peft_llama(lora_dropout=0.1), "dora": lambda: peft_llama(use_dora=True),
                         "embedding": lambda: peft_llama(target_modules=["q_proj", "embed_tokens"]),
                         "loha": lambda: get_peft_model(hf.build("llama"), LoHaConfig(r=4, target_modules=["q_proj"])),
                         "conv1d": lambda: get_peft_model(hf.build("gpt2"), LoraConfig(r=4, target_modules=["c_attn"]))
                         }.items():
        try:
            mg.parallelize(build(), mg.parallel.Layout(tp=2), verbose=False)
            out[label] = "not refused"
        except mg.UsageError as e:
            out[label] = str(e)
    return out


@pytest.mark.slow
def test_what_tensor_parallelism_cannot_do_exactly_with_adapters_is_refused_in_one_line(tmp_path):
    hf.build("llama").save_pretrained(tmp_path / "llama")
    said = spawn(_refusals, 2, str(tmp_path / "llama"), timeout=300)[0]
    for spec in ("{'tp': 2}", "{'dp_shard': 2}"):
        got = said.pop(f"spread first {spec}")
        assert "LlamaForCausalLM was spread before get_peft_model" in got and "\n" not in got, (spec, got)
    assert "lora_dropout=0.1" in said["dropout"] and "q_proj" in said["dropout"], said["dropout"]
    assert "DoRA (use_dora=True)" in said["dora"], said["dora"]
    assert "LoRA on an embedding" in said["embedding"] and "embed_tokens" in said["embedding"], said["embedding"]
    assert "a loha adapter Linear" in said["loha"], said["loha"]
    assert "a lora adapter Linear on a Conv1D" in said["conv1d"] and "c_attn" in said["conv1d"], said["conv1d"]
    assert all("\n" not in s and "use tp=1" in s for s in said.values()), said


def _own_model_gradients(dist) -> float:
    """A user's own model (no declared plan: the one found in its blocks) with LoRA on q, o and down, its
    adapters' B random (not PEFT's zeros, so that every adapter weight has a gradient): TP 2's adapter
    gradients against the same model on one process, on every rank."""
    from peft import LoraConfig, get_peft_model

    def build():
        torch.manual_seed(0)
        return get_peft_model(hf.TinyLM().double(), LoraConfig(r=4, target_modules=["attn.q", "attn.o", "mlp.down"],
                                                               init_lora_weights=False))

    x = torch.randint(0, hf.VOCAB, (2, 16), generator=torch.Generator().manual_seed(4))
    whole, spread = build(), mg.parallelize(build(), mg.parallel.Layout(tp=2), verbose=False)
    for model in (whole, spread):
        F.cross_entropy(_full(model(x)).flatten(0, 1), x.flatten()).backward()
    grads = dict(whole.named_parameters())
    return max(float((_full(p.grad) - grads[n].grad).abs().max()) for n, p in spread.named_parameters() if p.requires_grad)


@pytest.mark.slow
def test_a_found_plan_sees_through_the_adapters_of_a_users_own_model():
    assert max(spawn(_own_model_gradients, 2, timeout=300)) < TOL


def _checkpointed(dist, directory: str, spec: dict, resume: bool) -> dict:
    """2 of _train's steps on ``spec`` with a Checkpointer (save) or the rest from its checkpoint (resume)."""
    layout = mg.parallel.Layout(**spec).resolve(dist.world_size)
    model = mg.parallelize(peft_llama(), layout, verbose=False)
    opt = mg.optimizer(model, torch.optim.AdamW, lr=1e-2)
    ckpt = mg.Checkpointer(directory, model=model, optimizer=opt)
    start = ckpt.resume() if resume else 0
    n, i = layout.dp_size, layout.dp_rank(dist.rank)
    for step, batch in list(enumerate(_batches()))[start:None if resume else 2]:
        x = batch[i * 8 // n:(i + 1) * 8 // n]
        F.cross_entropy(_full(model(input_ids=x[:, :-1], use_cache=False).logits).flatten(0, 1),
                        x[:, 1:].flatten()).backward()
        mg.clip_grad_norm_(model, 0.5)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if not resume:
            ckpt.save(step)
    full = mg.full_state_dict(model)
    return {"start": start, "adapter": {k: v for k, v in full.items() if "lora_" in k}}


@pytest.mark.slow
def test_adapters_checkpointed_under_fsdp_resume_under_tp_as_one_process_continues(one_process, tmp_path):
    """The adapters' optimizer state (the only state there is) goes through mg.Checkpointer from one layout to
    another: 2 steps under FSDP 2, the other 2 resumed under TP 2, as one process's 4."""
    spawn(_checkpointed, 2, str(tmp_path), {"dp_shard": 2}, False, timeout=300)
    got = spawn(_checkpointed, 2, str(tmp_path), {"tp": 2}, True, timeout=300)[0]
    assert got["start"] == 2
    ref = one_process[""]["adapter"]
    diff = max(float((v - ref[k]).abs().max()) for k, v in got["adapter"].items())
    assert sorted(got["adapter"]) == sorted(ref)
    assert diff < TOL, diff  # 1.9e-16 here; a resume without the optimizer state fails this

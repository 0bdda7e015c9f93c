"""`multigpu ckpt import HF_DIR OUT`: a Hugging Face directory as a checkpoint mg.Checkpointer resumes from.

A tiny Llama (tied and untied head) and a Mixtral (its experts stored one tensor per expert) saved by
transformers' save_pretrained in float64, several shards, are imported; a 2-rank run resumes from them under
FSDP 2 and TP 2 (the Mixtral under EP 2), into a model built with other random weights: every parameter
bitwise transformers' from_pretrained, the optimizer fresh and the line that says so, step 0; one AdamW step
equals transformers' from_pretrained and a fresh AdamW's step on one process (float64, within 1e-9). Bad
input: one line, exit 2, nothing written.
"""

from __future__ import annotations

import contextlib
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import multigpu as mg
from multigpu.testing import spawn

pytest.importorskip("transformers")

LAYOUTS = {"tied": [{"dp_shard": 2}, {"tp": 2}], "untied": [{"dp_shard": 2}, {"tp": 2}], "mixtral": [{"ep": 2}]}
EAGER = {"mixtral": {"experts_implementation": "eager"}}  # grouped_mm takes no float64: both sides loop


def _config(name: str):
    from transformers import LlamaConfig, MixtralConfig

    if name == "mixtral":  # transformers 5 fuses the experts it stores one tensor per expert
        return MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    return LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, tie_word_embeddings=name == "tied")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "multigpu", "ckpt", *args], capture_output=True, text=True)


@pytest.fixture(scope="module")
def imported(tmp_path_factory) -> dict[str, tuple[str, str]]:
    """{tied, untied, mixtral}: (the Hugging Face directory, the run directory imported from it: by the CLI, by the
    call)."""
    from transformers import AutoModelForCausalLM

    from multigpu.checkpoint.hf_import import import_hf

    root = tmp_path_factory.mktemp("import")
    out = {}
    for name in LAYOUTS:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(_config(name), dtype=torch.float64).save_pretrained(
            root / name, max_shard_size="20KB")
        if name == "tied":
            done = _cli("import", str(root / name), str(root / f"run-{name}"))
            assert done.returncode == 0, done.stderr[-2000:]
            assert done.stdout.startswith(f"imported {root / name} -> {root / f'run-{name}' / 'step-0'}: "), done.stdout
        else:
            assert import_hf(root / name, root / f"run-{name}")["checkpoint"] == str(root / f"run-{name}" / "step-0")
        out[name] = (str(root / name), str(root / f"run-{name}"))
    return out


def _step(model, opt, x) -> float:
    loss = model(input_ids=x, labels=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return float(loss.detach())


def _resume_and_step(dist, imported: dict[str, tuple[str, str]]) -> dict:
    """Each model onto each layout, resumed from its imported run: (bitwise, optimizer state entries before the
    step, the step resume returned, the line said, the loss and parameters after one step against one
    process's)."""
    from transformers import AutoModelForCausalLM

    x = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))  # the same batch on every rank
    results = {}
    for name, (base, run) in imported.items():
        ref = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64, **EAGER.get(name, {})).train()
        own = {k: v.clone() for k, v in ref.state_dict().items()}
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
        ref_loss = _step(ref, ref_opt, x)
        for layout in LAYOUTS[name]:
            torch.manual_seed(123)  # other weights than the imported ones: the resume must replace every one
            model = AutoModelForCausalLM.from_config(_config(name), dtype=torch.float64, **EAGER.get(name, {}))
            model = mg.parallelize(model, mg.parallel.Layout(**layout), verbose=False).train()
            opt = mg.optimizer(model, torch.optim.AdamW, lr=1e-2)
            said = io.StringIO()
            with contextlib.redirect_stdout(said):
                step = mg.Checkpointer(run, model=model, optimizer=opt).resume()
            loaded = mg.full_state_dict(model)  # gathered on rank 0 (collective)
            got = {"step": step, "said": said.getvalue(), "state": len(opt.state), "loss": 0.0, "params": 0.0,
                   "bitwise": sorted(loaded) == sorted(own) and all(torch.equal(v, own[k]) for k, v in loaded.items())}
            got["loss"] = abs(_step(model, opt, x) - ref_loss)
            trained = mg.full_state_dict(model)
            if dist.rank == 0:
                got["params"] = max(float((v - ref.state_dict()[k]).abs().max()) for k, v in trained.items())
            else:
                got["bitwise"] = loaded == {}
            results[f"{name} {layout}"] = got
    return results


def test_an_imported_checkpoint_resumes_on_fsdp_and_tp_as_from_pretrained_with_a_fresh_optimizer(imported):
    out = spawn(_resume_and_step, 2, imported, timeout=300)
    assert len(out[0]) == 5
    for rank, results in enumerate(out):
        for name, got in results.items():
            assert got["bitwise"], (rank, name)
            assert got["step"] == 0 and got["state"] == 0, (rank, name, got)
            assert got["loss"] < 1e-9 and got["params"] < 1e-9, (rank, name, got)
            lines = got["said"].splitlines()
            if rank == 0:  # one line, by rank 0
                assert len(lines) == 1 and lines[0].startswith("multigpu: resumed from an imported checkpoint "), lines
                assert "the optimizer starts fresh, the data at its start; continuing at step 0" in lines[0]
            else:
                assert lines == [], lines


def test_ckpt_verify_and_ls_read_an_imported_checkpoint(imported):
    from multigpu.checkpoint import table

    base, run = imported["untied"]
    lines, bad = table(run, full=True)  # `multigpu ckpt verify`'s table
    assert bad == 0 and len(lines) == 2 and "imported" in lines[1] and lines[1].endswith("valid"), lines
    manifest = json.loads((Path(run) / "step-0" / "manifest.json").read_text())
    assert manifest["step"] == 0 and manifest["optimizer_fresh"] and manifest["state_keys"] == ["model"]
    assert manifest["imported"]["from"] == str(Path(base).resolve())


def test_ckpt_import_refuses_in_one_line_and_writes_nothing(imported, tmp_path):
    import shutil

    from multigpu.checkpoint.hf_import import import_hf

    base, run = imported["untied"]
    bare = tmp_path / "bare"
    bare.mkdir()
    pickled = tmp_path / "pickled"
    shutil.copytree(base, pickled)
    for f in pickled.glob("*.safetensors*"):
        f.unlink()
    (pickled / "pytorch_model.bin").write_bytes(b"not read")
    no_weights = tmp_path / "no-weights"
    no_weights.mkdir()
    shutil.copy(Path(base) / "config.json", no_weights)
    for source, target, says in ((bare, "a", "has no config.json"),
                                 (pickled, "b", r"has only pytorch_model.bin (pickle, never unpickled here)"),
                                 (no_weights, "c", "has no weights; expected model.safetensors"),
                                 (base, run, "writes a new run directory, but"),
                                 (base, pickled / "pytorch_model.bin" / "run", "could not write")):  # under a file
        with pytest.raises(mg.UsageError) as err:
            import_hf(source, tmp_path / target)
        assert says in str(err.value) and "\n" not in str(err.value), str(err.value)
    done = _cli("import", str(pickled), str(tmp_path / "b"))  # the CLI: that line, exit 2, no traceback
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and len(errors) == 1 and "has only pytorch_model.bin" in errors[0], done.stderr[-2000:]
    assert errors[0].startswith("multigpu ckpt: error: ") and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bare", "no-weights", "pickled"]

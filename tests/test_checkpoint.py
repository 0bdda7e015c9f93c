"""Checkpointer: exact resume, resharding, kills mid-training and mid-save, damage, keep-K, export, CLI.

Real gloo processes (testing.spawn, torchrun); several checks per spawn to keep the file fast.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import pickle
import random
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as tdist
import torch.distributed.checkpoint as dcp

import multigpu as mg
from multigpu.checkpoint import storage
from multigpu.cli import main as cli
from multigpu.testing import spawn

import ckpt_train
from ckpt_train import net, train

STEPS = 10


def _captured(fn, *args, **kwargs):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        result = fn(*args, **kwargs)
    return result, out.getvalue(), err.getvalue()


def _listing(path) -> list[str]:
    return sorted(p.name for p in Path(path).iterdir())


def _deterministic():
    torch.use_deterministic_algorithms(True)


# --- one 2-rank spawn: exact resume, keep-last-K, and a checkpoint to reshard ---------------

def _two_rank_runs(dist, root):
    _deterministic()
    exact, reshard = Path(root, "exact"), Path(root, "reshard")
    ref_dropout, _ = train(dist, steps=STEPS, dropout=0.2)
    # Crash after step 7: the last checkpoint is step 6, step 7 is lost and redone.
    _captured(train, dist, exact, steps=STEPS, every=2, keep=2, dropout=0.2, stop=7)
    after_stop = _listing(exact)
    (resumed, ckpt), out, err = _captured(train, dist, exact, steps=STEPS, every=2, keep=2, dropout=0.2)
    manifest = json.loads((exact / "step-8" / "manifest.json").read_text())
    # Resharding: no per-rank random draws, so the run is world-size invariant up to float rounding.
    ref, _ = train(dist, steps=STEPS, noise=False)
    (at5, _), _, _ = _captured(train, dist, reshard, steps=STEPS, every=5, stop=5, noise=False)
    # ZeRO-1 (ZeroRedundancyOptimizer): sharded optimizer state, same checkpoint format.
    zero, zero_copy = Path(root, "zero"), Path(root, "zero-copy")
    ref_zero, _ = train(dist, steps=STEPS, noise=False, zero=True)
    _captured(train, dist, zero, steps=STEPS, every=5, stop=5, noise=False, zero=True)
    if dist.rank == 0:
        shutil.copytree(zero, zero_copy)  # pristine, for the resharding test
    tdist.barrier()
    (zero_resumed, _), zero_out, _ = _captured(train, dist, zero, steps=STEPS, every=5, noise=False, zero=True)
    return dict(ref_dropout=ref_dropout, resumed=resumed, after_stop=after_stop, after_resume=_listing(exact),
                out=out, err=err, extra=ckpt.extra, manifest=manifest, ref=ref, at5=at5,
                ref_zero=ref_zero, zero_resumed=zero_resumed, zero_out=zero_out)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return root, spawn(_two_rank_runs, 2, str(root))


def test_exact_resume_is_bitwise_and_keeps_last_k(two_ranks):
    root, results = two_ranks
    for r in results:
        # Dropout, python and numpy draws, Adam, StepLR, loader position: all restored exactly.
        for a, b in zip(r["resumed"], r["ref_dropout"]):
            assert torch.equal(a, b)
        assert r["after_stop"] == ["step-4", "step-6"]
        assert r["after_resume"] == ["step-6", "step-8"]
    out = results[0]["out"]
    assert f"resumed from {root / 'exact' / 'step-6'} (step 6, written by 2 ranks, now 2); continuing at step 7" in out
    assert results[1]["out"] == ""  # only rank 0 talks
    assert isinstance(results[0]["extra"]["last_loss"], float)
    m = results[0]["manifest"]
    assert m["step"] == 8 and m["world_size"] == 2 and m["strategy"] == "ddp"
    assert m["loader"]["epoch"] == 1 and m["loader"]["batch_index"] == 3  # 6 batches per epoch, step 8 done
    assert set(m["files"]) >= {".metadata", "rng/rank-0.pt", "rng/rank-1.pt"}
    assert m["bytes"] == sum(f["bytes"] for f in m["files"].values()) and m["versions"]["torch"] == torch.__version__
    for r in results:  # ZeRO-1: exact too, and the same update as plain DDP + Adam
        for a, b, c in zip(r["zero_resumed"], r["ref_zero"], r["ref"]):
            assert torch.equal(a, b)
            torch.testing.assert_close(b, c, rtol=1e-5, atol=1e-6)
    assert "resumed from " + str(root / "zero" / "step-5") + " (step 5, written by 2 ranks, now 2)" in results[0]["zero_out"]
    assert json.loads((root / "zero" / "step-5" / "manifest.json").read_text())["strategy"] == "zero1"


# --- resharding: a 2-rank checkpoint resumes on 1 and on 4 ranks -------------------------------

def _resume_elsewhere(dist, root, dst):
    _deterministic()
    if dist.rank == 0:
        shutil.copytree(Path(root, "reshard"), Path(dst, "ddp"))
        shutil.copytree(Path(root, "zero-copy"), Path(dst, "zero"))
    tdist.barrier()
    (params, _), out, err = _captured(train, dist, Path(dst, "ddp"), steps=STEPS, every=5, noise=False)
    # A ZeRO-1 checkpoint: on 4 ranks with ZeRO-1 again (its shards re-cut), on 1 rank with a plain Adam.
    (zero_params, _), zero_out, _ = _captured(train, dist, Path(dst, "zero"), steps=STEPS, every=5, noise=False,
                                              zero=dist.world_size > 1)
    return params, out + zero_out, zero_params


@pytest.mark.parametrize("world", [1, 4])
def test_resharding_continues_the_same_data_order(two_ranks, tmp_path, world):
    root, results = two_ranks
    got = spawn(_resume_elsewhere, world, str(root), str(tmp_path / "run"))
    ref = results[0]["ref"]  # uninterrupted 2-rank run
    for params, _, zero_params in got:
        for a, b, c in zip(params, ref, zero_params):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6)
    out = got[0][1]
    assert f"ddp/step-5 (step 5, written by 2 ranks, now {world}); continuing at step 6" in out
    assert "world size changed 2 -> " + str(world) in out
    assert ("ranks 2-3: reseeded from (step, rank)" in out) == (world > 2)
    assert ("saved states of rank 1: dropped" in out) == (world < 2)
    if world == 1:
        assert "zero/step-5 (step 5, written by 2 ranks, now 1, zero1 -> ddp); continuing at step 6" in out


# --- kill -9 during saves and during training, then automatic restart ---------------------------

def _kill_in_save(dist, directory, where, async_save=False):
    """Train with dropout and noise like the fixture's reference; SIGKILL rank 0 inside a save
    (with ``async_save``, inside the background thread's hashing, the loop already past the save)."""
    _deterministic()
    if where == "hashing-step4" and dist.rank == 0:
        real = storage.hash_files

        def hash_then_die(root, names):
            if Path(root).name == ".tmp-step-4":
                os.kill(os.getpid(), signal.SIGKILL)  # DCP files written, no manifest yet
            return real(root, names)

        storage.hash_files = hash_then_die
    if where == "marker-step8" and dist.rank == 0:
        real_write = storage.write_durable

        def die_before_marker(path, data):
            if path.name == storage.MARKER and path.parent.name == "step-8":
                os.kill(os.getpid(), signal.SIGKILL)  # renamed to step-8, marker never written
            return real_write(path, data)

        storage.write_durable = die_before_marker
    train(dist, directory, steps=STEPS, every=2, dropout=0.2, async_save=async_save)


def test_kills_during_save_and_training_lose_nothing(two_ranks, tmp_path, capfd):
    """Killed mid-save twice (spawn), then under `multigpu run --max-restarts` a random rank is killed
    at a random step; the final parameters equal the uninterrupted run's, bit for bit."""
    run = tmp_path / "run"
    killed = "exited with code -9|Connection reset|Connection closed"  # the dead rank, or its peer noticing first
    with pytest.raises(RuntimeError, match=killed):
        spawn(_kill_in_save, 2, str(run), "hashing-step4")
    assert _listing(run) == [".tmp-step-4", "step-0", "step-2"]
    capfd.readouterr()
    with pytest.raises(RuntimeError, match=killed):
        spawn(_kill_in_save, 2, str(run), "marker-step8")
    out, err = capfd.readouterr()
    assert f"skipping {run}/.tmp-step-4: incomplete" in err
    assert f"resumed from {run}/step-2 (step 2" in out
    assert _listing(run) == [f"step-{i}" for i in (0, 2, 4, 6, 8)]  # the stale .tmp-step-4 was replaced
    assert not (run / "step-8" / storage.MARKER).exists()

    seed = random.randrange(1 << 30)
    rnd = random.Random(seed)
    kill_rank, kill_step = rnd.randrange(2), rnd.randrange(7, STEPS)
    out_file = tmp_path / "params.pt"
    cmd = [sys.executable, "-m", "multigpu", "run", "-n", "2", "--cpu", "--max-restarts", "2",
           "--log-dir", str(tmp_path / "logs"), ckpt_train.__file__,
           "--dir", str(run), "--steps", str(STEPS), "--every", "2", "--dropout", "0.2",
           "--kill-rank", str(kill_rank), "--kill-step", str(kill_step), "--out", str(out_file)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    log = proc.stdout + proc.stderr
    where = f"seed {seed}: kill rank {kill_rank} at step {kill_step}"
    assert proc.returncode == 0, f"{where}\n{log[-3000:]}"
    assert f"skipping {run}/step-8: incomplete" in log, where
    assert f"resumed from {run}/step-6 (step 6, written by 2 ranks, now 2); continuing at step 7" in log, where
    saved = kill_step - kill_step % 2  # save() runs before the kill within a step
    assert f"resumed from {run}/step-{saved} (step {saved}, written by 2 ranks, now 2)" in log, where
    ref = two_ranks[1][0]["ref_dropout"]  # the fixture's uninterrupted 2-rank run
    for a, b in zip(torch.load(out_file, weights_only=True), ref):
        assert torch.equal(a, b), where
    assert all(storage.verify(run / f"step-{i}")[1] == [] for i in (0, 2, 4, 6, 8))


def test_checksums_are_xxh3_and_older_sha256_manifests_still_verify(tmp_path):
    f = tmp_path / "a.bin"
    f.write_bytes(b"x" * 100_000)
    import hashlib

    import xxhash

    assert storage.hash_files(tmp_path, ["a.bin"]) == {"a.bin": {"bytes": 100_000, "xxh3_128": xxhash.xxh3_128(f.read_bytes()).hexdigest()}}
    old = {"files": {"a.bin": {"bytes": 100_000, "sha256": hashlib.sha256(f.read_bytes()).hexdigest()}}}
    assert storage.check_hashes(tmp_path, old, ["a.bin"]) == []
    f.write_bytes(b"y" + b"x" * 99_999)
    assert storage.check_hashes(tmp_path, old, ["a.bin"]) == [f"{f} has changed bytes (sha256 mismatch)"]
    assert "no checksum" in storage.check_hashes(tmp_path, {"files": {"a.bin": {"bytes": 100_000}}}, ["a.bin"])[0]


def test_a_background_save_is_completed_when_the_init_block_ends_even_by_sys_exit_0(tmp_path, monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(SystemExit) as exc:
        with mg.init(seed=0):
            ckpt = mg.Checkpointer(tmp_path / "run", model=model, async_save=True)
            ckpt.save(0)
            assert _listing(tmp_path / "run") == [".tmp-step-0"]
            sys.exit(0)
    assert exc.value.code == 0
    assert _listing(tmp_path / "run") == ["step-0"] and storage.verify(tmp_path / "run" / "step-0")[1] == []


# --- async saves: exact, durable, failures raised at the next save -------------------------------

def _async_runs(dist, root):
    _deterministic()
    root = Path(root)
    out = {}
    ref, _ = train(dist, steps=STEPS, dropout=0.2)
    out["after_crash"] = _listing(root / "a")
    (resumed, ckpt), o, _ = _captured(train, dist, root / "a", steps=STEPS, every=2, dropout=0.2, async_save=True)
    out["resumed"] = o
    out["pending_before_finish"] = _listing(root / "a")
    ckpt.finish()
    out["exact"] = all(torch.equal(a, b) for a, b in zip(resumed, ref))
    out["final"] = _listing(root / "a")
    out["verified"] = [storage.verify(root / "a" / f"step-{i}")[1] for i in (0, 2, 4, 6, 8)]
    m = storage.read_manifest(root / "a" / "step-8")
    out["seconds"] = (m["blocking_seconds"], m["save_seconds"])
    # A background write fails on rank 1 (no space): the next save raises it on every rank, and
    # the previous checkpoint stays the newest valid one.
    _, ckpt = train(dist, root / "b", steps=3, every=2, async_save=True)   # step-0, step-2 in flight
    ckpt.finish()
    real = dcp.FileSystemWriter.write_data

    def no_space(self, plan, planner):
        if dist.rank == 1 and Path(self.path).name == ".tmp-step-4":
            raise OSError(28, "No space left on device")
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = no_space
    try:
        ckpt.save(4, force=True)   # staged, the write fails on its thread
        ckpt.save(6, force=True)
    except mg.UsageError as err:
        out["error"] = str(err)
    finally:
        dcp.FileSystemWriter.write_data = real
    out["after_failure"] = _listing(root / "b")
    # The write is a copy's: parameters changed right after save() (the writer held back 0.3 s) are not in it.
    _, ckpt = train(dist, root / "c", steps=1, every=1, async_save=True)
    ckpt.finish()
    import time as _time

    def slow(self, plan, planner):
        _time.sleep(0.3)
        return real(self, plan, planner)

    dcp.FileSystemWriter.write_data = slow
    try:
        model = mg.unwrap(ckpt.model)
        before = [p.detach().clone() for p in model.parameters()]
        ckpt.save(1, force=True)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        ckpt.finish()
    finally:
        dcp.FileSystemWriter.write_data = real
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    ckpt.resume()
    out["staged_copy"] = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    return out


def test_async_saves_are_exact_durable_and_report_background_failures(tmp_path):
    # Rank 0 is SIGKILLed inside the background hashing of step 4, the loop already past save(4), which
    # had completed step-2 first: step-4 is never completed.
    with pytest.raises(RuntimeError, match="exited with code -9|Connection reset|Connection closed"):
        spawn(_kill_in_save, 2, str(tmp_path / "a"), "hashing-step4", async_save=True)
    res = spawn(_async_runs, 2, str(tmp_path), timeout=240)
    r = res[0]
    assert r["after_crash"] == [".tmp-step-4", "step-0", "step-2"]
    assert f"resumed from {tmp_path}/a/step-2 (step 2" in r["resumed"]
    # save(8) completed step-6; step-8 waits for finish() (the stale .tmp-step-4 was replaced).
    assert r["pending_before_finish"] == [".tmp-step-8", "step-0", "step-2", "step-4", "step-6"]
    assert r["exact"] and res[1]["exact"]   # bit for bit, though training ran on during every write
    assert r["final"] == [f"step-{i}" for i in (0, 2, 4, 6, 8)] and r["verified"] == [[]] * 5
    blocked, total = r["seconds"]
    assert 0 < blocked <= total
    for rank in res:
        err = rank["error"]
        assert "writing tensors in the background (DCP) failed on rank 1" in err and "No space left" in err
        assert f"the previous checkpoint {tmp_path}/b/step-2 is intact" in err and "\n" not in err
    assert r["after_failure"] == ["step-0", "step-2"]
    assert r["staged_copy"] and res[1]["staged_copy"]


# --- disk full and damaged checkpoints, one 2-rank spawn ----------------------------------------

def _damage(kind, ck: Path):
    data = sorted(ck.glob("*.distcp"))[0]
    if kind == "flip":
        raw = bytearray(data.read_bytes())
        raw[len(raw) // 2] ^= 0xFF
        data.write_bytes(bytes(raw))
    elif kind == "truncate":
        with open(data, "r+b") as f:
            f.truncate(data.stat().st_size // 2)
    elif kind == "manifest":
        m = ck / storage.MANIFEST
        m.write_text(m.read_text().replace('"world_size": 2', '"world_size": 3'))
    elif kind in ("metadata", "rng"):
        # A planted pickle that would create a directory when loaded (.metadata, or rank 0's
        # RNG file read by torch.load), with manifest and marker rewritten so every checksum matches.
        name = ".metadata" if kind == "metadata" else "rng/rank-0.pt"
        if kind == "metadata":
            (ck / name).write_bytes(pickle.dumps(_Planted(str(ck / "pwned"))))
        else:
            torch.save({"cpu": _Planted(str(ck / "pwned"))}, ck / name)
        manifest = json.loads((ck / storage.MANIFEST).read_text())
        manifest["files"][name] = dict(zip(("bytes", "xxh3_128"), storage.file_digest(ck / name)))
        storage.write_durable(ck / storage.MANIFEST, (json.dumps(manifest) + "\n").encode())
        import hashlib

        digest = hashlib.sha256((ck / storage.MANIFEST).read_bytes()).hexdigest()
        (ck / storage.MARKER).write_text(json.dumps({"format": storage.FORMAT, "manifest_sha256": digest}))


class _Planted:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.mkdir, (self.path,))


def _disk_full_and_damage(dist, root):
    _deterministic()
    root = Path(root)
    run = root / "run"
    _, ckpt = train(dist, run, steps=6, every=2)  # step-0, step-2, step-4
    report = {}
    # Disk full: rank 1 may write files of at most 2 kB (a real EFBIG from write()).
    if dist.rank == 1:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
        resource.setrlimit(resource.RLIMIT_FSIZE, (2000, hard))
    try:
        ckpt.save(6, force=True)
        report["disk_full"] = None
    except mg.UsageError as err:
        report["disk_full"] = str(err)
    if dist.rank == 1:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    tdist.barrier()
    report["after_full"] = _listing(run)
    report["step4_ok"] = storage.verify(run / "step-4")[1] == []
    for kind in ("flip", "truncate", "manifest", "metadata", "rng"):
        copy = root / kind
        if dist.rank == 0:
            shutil.copytree(run, copy)
            _damage(kind, copy / "step-4")
        tdist.barrier()
        _, out, err = _captured(train, dist, copy, steps=3, every=100)
        report[kind] = (out, err, (copy / "step-4" / "pwned").exists())
    # Asking for the damaged one by name is an error that names it.
    try:
        ck = mg.Checkpointer(root / "flip", model=mg.wrap(net(), "ddp"))
        ck.resume("step-4")
        report["explicit"] = None
    except mg.UsageError as err:
        report["explicit"] = str(err)
    # Every checkpoint damaged: stop, do not silently start over.
    if dist.rank == 0:
        for ck in (root / "truncate").glob("step-*"):
            _damage("truncate", ck)
    tdist.barrier()
    try:
        mg.Checkpointer(root / "truncate", model=mg.wrap(net(), "ddp")).resume()
        report["all_damaged"] = None
    except mg.UsageError as err:
        report["all_damaged"] = str(err)
    return report


def test_disk_full_and_damaged_checkpoints(tmp_path):
    results = spawn(_disk_full_and_damage, 2, str(tmp_path))
    run = tmp_path / "run"
    for rep in results:  # every rank gets the same error; nothing hangs
        msg = rep["disk_full"]
        assert msg is not None and msg.startswith(f"could not save checkpoint {run}/step-6: ")
        assert "failed on rank 1" in msg and "File too large" in msg
        assert f"the previous checkpoint {run}/step-4 is intact" in msg
        assert rep["after_full"] == ["step-0", "step-2", "step-4"] and rep["step4_ok"]
        assert rep["explicit"].startswith(f"checkpoint {tmp_path}/flip/step-4 cannot be loaded: ")
        assert "changed bytes (xxh3_128 mismatch)" in rep["explicit"]
        assert rep["all_damaged"].startswith(f"no valid checkpoint in {tmp_path}/truncate: all 3 complete ones are damaged")
    rep = results[0]
    reasons = {
        "flip": "__0_0.distcp has changed bytes (xxh3_128 mismatch)",
        "truncate": "expected",
        "manifest": "manifest.json does not match the hash in its COMPLETE marker",
        "metadata": ".metadata refers to posix.mkdir, which a DCP checkpoint never contains",
        "rng": "rng/rank-0.pt cannot be read safely (UnpicklingError: Weights only load failed",
    }
    for kind, reason in reasons.items():
        out, err, pwned = rep[kind]
        assert f"warning: skipping damaged checkpoint {tmp_path}/{kind}/step-4: " in err
        assert reason in err
        assert f"resumed from {tmp_path}/{kind}/step-2 (step 2" in out
        assert not pwned


# --- CLI, export, bad input (in this process, on the 2-rank checkpoints) ---------------------------

def test_cli_ls_verify_export_and_plain_torch_load(two_ranks, tmp_path, capsys):
    root, results = two_ranks
    assert cli(["ckpt", "ls", str(root / "exact")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:3] == ["checkpoint", "step", "world"]
    assert [ln.split()[1:4] for ln in lines[1:]] == [["8", "2", "ddp"], ["6", "2", "ddp"]]
    assert all(ln.endswith("complete (sizes ok)") for ln in lines[1:])
    copy = tmp_path / "copy"
    shutil.copytree(root / "exact", copy)
    assert cli(["ckpt", "verify", str(copy)]) == 0
    assert capsys.readouterr().out.splitlines()[-1] == "all checkpoints valid"
    _damage("flip", copy / "step-6")
    assert cli(["ckpt", "verify", str(copy)]) == 1
    out = capsys.readouterr().out
    assert "NOT VALID: " + str(copy / "step-6") + "/__0_0.distcp has changed bytes" in out
    assert out.splitlines()[-1] == "1 of 2 checkpoints not valid"
    target = tmp_path / "model.pt"
    assert cli(["ckpt", "export", str(root / "reshard" / "step-5"), str(target)]) == 0
    assert "load with model.load_state_dict(torch.load(path, weights_only=True))" in capsys.readouterr().out
    model = net()
    model.load_state_dict(torch.load(target, weights_only=True))  # strict: same keys, no prefixes
    for a, b in zip(model.parameters(), results[0]["at5"]):
        assert torch.equal(a, b)


def test_bad_input_is_one_clear_line(two_ranks, tmp_path, capsys):
    root, _ = two_ranks
    for argv in (["ckpt", "ls", str(tmp_path / "missing")], ["ckpt", "export", str(tmp_path / "nope"), "x.pt"]):
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "does not exist" in err[0]
    # Nothing to verify is not "all checkpoints valid": a wrong directory must fail a CI step.
    (tmp_path / "empty").mkdir()
    assert cli(["ckpt", "verify", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"no checkpoints in {tmp_path / 'empty'} to verify" in err[0]
    # Wrong architecture: the message names the keys and shapes (no process group needed).
    ckpt = mg.Checkpointer(root / "reshard", model=net(hidden=64))
    with pytest.raises(mg.UsageError) as info:
        ckpt.resume()
    msg = str(info.value)
    assert "does not fit this model" in msg and "0.weight checkpoint (32, 10) vs model (64, 10)" in msg
    assert "3.weight checkpoint (2, 32) vs model (2, 64)" in msg
    # Another optimizer type: DCP's missing key, named, as a usage error.
    model = net()
    ckpt = mg.Checkpointer(root / "reshard", model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    with pytest.raises(mg.UsageError, match=r"does not match this run's state \(RuntimeError: Missing key in checkpoint "
                                            r"state_dict: optim\.state\.0\.weight\.momentum_buffer"):
        ckpt.resume()
    with pytest.raises(mg.UsageError, match="reshard/step-99 cannot be loaded: does not exist"):
        mg.Checkpointer(root / "reshard", model=net()).resume("step-99")
    (tmp_path / "afile").write_text("x")
    with pytest.raises(mg.UsageError, match="exists but is a file"):
        mg.Checkpointer(tmp_path / "afile", model=net())
    with pytest.raises(mg.UsageError, match="every= must be a positive integer"):
        mg.Checkpointer(tmp_path / "d", every=0, model=net())
    with pytest.raises(mg.UsageError, match="must be a plain value"):
        mg.Checkpointer(tmp_path / "d", model=net(), when=object())


def test_saving_before_the_first_step_changes_nothing(tmp_path):
    """get_state_dict gives a fresh Adam a zero-lr step; neither the run nor its resume may see it."""

    def run(directory, resume):
        torch.manual_seed(0)
        model = net()
        opt = torch.optim.Adam(model.parameters(), lr=0.01)
        ckpt = mg.Checkpointer(directory, model=model, optimizer=opt)
        if resume:
            _captured(ckpt.resume)
        else:
            _captured(ckpt.save, 0, force=True)  # no process group: one process
        x, y = torch.randn(8, 10, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1] * 4)
        for _ in range(3):
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()], opt.state_dict()["state"][0]["step"]

    saved, saved_steps = run(tmp_path / "a", False)
    resumed, resumed_steps = run(tmp_path / "a", True)
    torch.manual_seed(0)
    model = net()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y = torch.randn(8, 10, generator=torch.Generator().manual_seed(1)), torch.tensor([0, 1] * 4)
    for _ in range(3):
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b, c in zip(saved, resumed, model.parameters()):
        assert torch.equal(a, c) and torch.equal(b, c)
    assert float(saved_steps) == float(resumed_steps) == 3.0


def test_next_save_removes_leftovers_of_killed_saves(tmp_path):
    run = tmp_path / "run"
    for junk in (".tmp-step-3", "step-5", ".tmp-old-step-2"):  # no COMPLETE marker in any of them
        (run / junk).mkdir(parents=True)
        (run / junk / "__0_0.distcp").write_bytes(b"partial")
    ckpt = mg.Checkpointer(run, keep=2, model=net())
    assert _captured(ckpt.resume)[0] == 0  # nothing complete to resume
    for step in (6, 7, 8):
        _captured(ckpt.save, step)
    assert _listing(run) == ["step-7", "step-8"]


# --- what a resume loads into: copies, never what an object handed out ---------------------------------

def _one_process():
    return mg.Dist(rank=0, local_rank=0, world_size=1, local_world_size=1, device=torch.device("cpu"),
                   backend="gloo")


def _record_x(record):
    return torch.tensor(record["x"])


def test_a_loader_given_as_an_extra_refuses_changed_data_as_loader_does(tmp_path):
    """An extra is the only way to save a second loader. The Checkpointer loaded the saved position into the
    dict the loader's state_dict() returned, which held the loader's own source fingerprint: the loader then
    compared the saved fingerprint with itself and resumed over a .jsonl shard with a line appended."""
    shard = tmp_path / "a.jsonl"
    shard.write_text("".join(json.dumps({"x": i}) + "\n" for i in range(40)))

    def checkpointer(as_extra: bool):
        loader = mg.stream_loader(str(shard), mg.BatchPlan(4, 1), _one_process(), buffer=8, transform=_record_x)
        given = {"held_out": loader} if as_extra else {"loader": loader}
        return mg.Checkpointer(tmp_path / ("extra" if as_extra else "loader"), model=net(), **given), loader

    for as_extra in (True, False):
        ckpt, loader = checkpointer(as_extra)
        batches = iter(loader)
        next(batches), next(batches)
        _captured(ckpt.save, 2, force=True)
        ckpt, loader = checkpointer(as_extra)  # the same data: resumed where it stopped
        assert _captured(ckpt.resume)[0] == 3 and loader.state_dict()["batch_index"] == 2
    with shard.open("a") as f:
        f.write(json.dumps({"x": 99}) + "\n")
    for as_extra in (True, False):
        ckpt, _ = checkpointer(as_extra)
        with pytest.raises(mg.UsageError) as err:
            _captured(ckpt.resume)
        assert str(err.value).startswith("the saved loader position is for other data (source.shards[0][1] was "
                                         "390, is 400)"), (as_extra, str(err.value))


class _HandsOutItsOwn:
    """A stateful extra whose state_dict() is its own containers and tensor (what the loader did with its source)."""

    def __init__(self, tag: str, value: float) -> None:
        self.own = {"tag": tag, "nested": {"names": [tag]}, "t": torch.full((2,), value)}
        self.loaded = None

    def state_dict(self):
        return {"inner": self.own}

    def load_state_dict(self, state):
        self.loaded = state


def test_a_resume_never_writes_into_what_an_object_handed_out(tmp_path):
    _captured(mg.Checkpointer(tmp_path, obj=_HandsOutItsOwn("saved", 7.0)).save, 0, force=True)
    fresh = _HandsOutItsOwn("fresh", 1.0)
    _captured(mg.Checkpointer(tmp_path, obj=fresh).resume)
    assert fresh.own["tag"] == "fresh" and fresh.own["nested"] == {"names": ["fresh"]}
    assert fresh.own["t"].tolist() == [1.0, 1.0]
    loaded = fresh.loaded["inner"]
    assert loaded["tag"] == "saved" and loaded["nested"] == {"names": ["saved"]} and loaded["t"].tolist() == [7.0, 7.0]
    stream = mg.stream_loader([[1, 2, 3, 4]], mg.BatchPlan(2, 1), _one_process())
    stream.state_dict()["source"]["shards"].clear()  # what a caller does with the state is not the loader's
    assert stream.state_dict()["source"]["shards"] != []
    mapped = mg.loader(_Described(torch.arange(8)), mg.BatchPlan(2, 1), _one_process())
    mapped.state_dict()["source"]["files"].clear()
    assert mapped.state_dict()["source"]["files"] == ["a.bin"]


class _Described(torch.utils.data.TensorDataset):
    fingerprint = {"kind": "files", "files": ["a.bin"]}  # what mg.loader puts in its position as the source

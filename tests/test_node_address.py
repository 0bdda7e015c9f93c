"""Where a node is reached (launch/network.py) and where SLURM's first node is (launch/slurm.py), in process.

The real cases, separate hosts and a real SLURM, are tests/test_hosts.py and
tests/test_slurm.py (root only); these need nothing: a fake ``scontrol`` on PATH
stands for SLURM's.
"""

from __future__ import annotations

import os
import stat

import pytest

from multigpu.errors import UsageError
from multigpu.launch import RunConfig, network, resolve, slurm
from multigpu.launch.start import _torchrun_argv, _worker_variables

SLURM_ENV = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_NTASKS": "2",
             "SLURM_JOB_NODELIST": "n[0-1]"}


def test_a_node_is_reached_at_its_source_address_on_the_route_to_the_master():
    assert network.node_address("127.0.0.1", 29500) == ("127.0.0.1", "lo")
    assert network.route_source("nohost.invalid", 1) is None and network.node_address("nohost.invalid", 1) is None


def test_a_host_name_that_routes_to_loopback_is_left_to_torch(monkeypatch):
    """node 0's own /etc/hosts maps its name to 127.0.1.1: the others may resolve the name correctly."""
    monkeypatch.setattr(network, "route_source", lambda host, port: "127.0.1.1")
    assert network.node_address("node0", 29500) is None
    assert network.node_address("127.0.0.1", 29500) == ("127.0.1.1", network.interface_of("127.0.1.1"))


def test_the_launcher_passes_the_address_and_gloos_interface(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    cfg = RunConfig(str(script), nnodes=2, node_rank=1, master="127.0.0.1:29500", cpu=True)
    place = resolve(cfg, environ={})
    assert "--local-addr=10.1.2.3" in _torchrun_argv(cfg, place, "10.1.2.3")
    assert not [a for a in _torchrun_argv(cfg, place) if a.startswith("--local-addr")]
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    env = _worker_variables(cfg, place, str(tmp_path), None, 0, ("10.1.2.3", "ib0"))
    assert env["GLOO_SOCKET_IFNAME"] == ("ib0", "gloo's interface: 10.1.2.3, this node's route to the master")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth1")  # the user's choice stays
    assert "GLOO_SOCKET_IFNAME" not in _worker_variables(cfg, place, str(tmp_path), None, 0, ("10.1.2.3", "ib0"))


def _scontrol(tmp_path, monkeypatch, body: str | None) -> None:
    """PATH holds only a fake scontrol running ``body`` (None: no scontrol at all)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    if body is not None:
        fake = bin_dir / "scontrol"
        fake.write_text(f"#!/bin/sh\n{body}\n")
        fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", str(bin_dir))


def test_slurms_node_addr_is_the_master(tmp_path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, 'echo "NodeName=$3 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=$3"')
    assert slurm.master_address("n0", 24242, "2") == ("127.0.0.1", "`scontrol show node n0`: NodeAddr")


def test_without_scontrol_a_name_that_resolves_is_used(tmp_path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, None)
    assert slurm.master_address("localhost", 24242, "2") == ("localhost", "its node name")


def test_a_first_node_nothing_places_is_one_line(tmp_path, monkeypatch):
    _scontrol(tmp_path, monkeypatch, 'echo "slurm_load_node error: Invalid node name specified" >&2; exit 1')
    with pytest.raises(UsageError) as err:
        slurm.master_address("n0.invalid", 24242, "1:2")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("the job's first SLURM node 'n0.invalid', where node 0 hosts the rendezvous, does not resolve (")
    assert text.endswith("), and `scontrol show node n0.invalid` gave no address (slurm_load_node error: Invalid node name "
                         "specified); give its address yourself on every node: multigpu run --nnodes 1:2 --node-rank "
                         "$SLURM_NODEID --master ADDRESS:24242 ...")


def test_multigpu_run_inside_srun_refuses_an_unplaceable_first_node(tmp_path, monkeypatch, capsys):
    from multigpu.cli import main

    (tmp_path / "train.py").write_text("print('never runs')\n")
    monkeypatch.chdir(tmp_path)
    for name, value in {**SLURM_ENV, "SLURM_JOB_NODELIST": "n[0-1].invalid"}.items():
        monkeypatch.setenv(name, value)
    _scontrol(tmp_path, monkeypatch, None)
    assert main(["run", "--cpu", "train.py"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multigpu run: error: the job's first SLURM node 'n0.invalid', where node 0 hosts the "
                          "rendezvous, does not resolve (") and err.count("\n") == 1, err
    assert "and no scontrol on this node; give its address yourself" in err
    assert sorted(os.listdir(tmp_path)) == ["bin", "train.py"]  # nothing started, no log folder

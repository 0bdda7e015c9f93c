"""multigpu doctor: rules against fabricated machines, and live runs on CPU."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest

from multigpu.doctor import Facts, Finding, format_findings, lint_env, run_doctor, worst
from multigpu.doctor.checks import (Gpu, Iface, Versions, check_devices, check_interfaces, check_nofile, check_p2p,
                                    check_port, check_secrets, check_shm, check_versions, port_in_use)
from multigpu.doctor.findings import REDACTED, redact
from multigpu.doctor.rules import filter_admits, lint_variable, merge_env, parse_filter
from multigpu.doctor.table import DEBUG, DEPRECATED, KNOWN_TORCH, NONEXISTENT
from multigpu.doctor.smoke import likely_cause, run_smoke
from multigpu.doctor.topology import parse_topo_matrix

from _cli import run_cli

# `nvidia-smi topo -m` of an 4x H100 SXM node with two NICs, colour codes included.
NVLINK_TOPO = """\x1b[4m\tGPU0\tGPU1\tGPU2\tGPU3\tNIC0\tNIC1\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID\x1b[0m
GPU0\t X \tNV18\tNV18\tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU1\tNV18\t X \tNV18\tNV18\tPXB\tSYS\t0-55,112-167\t0\t\tN/A
GPU2\tNV18\tNV18\t X \tNV18\tSYS\tPXB\t56-111,168-223\t1\t\tN/A
GPU3\tNV18\tNV18\tNV18\t X \tSYS\tPXB\t56-111,168-223\t1\t\tN/A
NIC0\tPXB\tPXB\tSYS\tSYS\t X \tSYS
NIC1\tSYS\tSYS\tPXB\tPXB\tSYS\t X

Legend:

  X    = Self
  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes (e.g., QPI/UPI)
  NV#  = Connection traversing a bonded set of # NVLinks

NIC Legend:

  NIC0: mlx5_0
  NIC1: mlx5_1
"""

# Two consumer GPUs on PCIe, across sockets.
PCIE_TOPO = """        GPU0    GPU1    CPU Affinity    NUMA Affinity
GPU0     X      SYS     0-15    0
GPU1    SYS      X      16-31   1

Legend:
  X    = Self
"""

IFACES = ("lo", "eth0", "docker0")
IB = ("mlx5_0", "mlx5_1", "mlx5_10", "mlx5_11")


def one(env, facts=Facts(), **kw) -> Finding:
    found = lint_env(env, facts, **kw)
    assert len(found) == 1, found
    return found[0]


# -- topology ---------------------------------------------------------------------------


def test_parse_nvlink_topology():
    t = parse_topo_matrix(NVLINK_TOPO)
    assert t.gpus == ["GPU0", "GPU1", "GPU2", "GPU3"]
    assert t.nvlink and t.links[("GPU1", "GPU2")] == "NV18" and t.links[("GPU0", "NIC1")] == "SYS"
    assert t.links[("GPU0", "GPU0")] == "X"
    assert t.nics == {"NIC0": "mlx5_0", "NIC1": "mlx5_1"}
    assert len(t.nvlink_pairs()) == 6
    assert "NVLink present" in t.summary()


def test_parse_pcie_topology():
    t = parse_topo_matrix(PCIE_TOPO)
    assert t.gpus == ["GPU0", "GPU1"] and not t.nvlink and t.links[("GPU0", "GPU1")] == "SYS"
    found = check_devices([Gpu(0, "RTX 4090", 24 * 2**30, (8, 9)), Gpu(1, "RTX 4090", 24 * 2**30, (8, 9))], t)
    assert found[-1].status == "warning" and "across CPU sockets" in found[-1].what
    nv = check_devices([Gpu(i, "H100", 80 * 2**30, (9, 0)) for i in range(4)], parse_topo_matrix(NVLINK_TOPO))
    assert worst(nv) == "ok" and "NV18" in nv[-1].what


class _FakeNvml:
    """Enough of pynvml for nvml_topology(): PCI ids, NVLink states and their remote ends."""

    NVML_FEATURE_ENABLED = 1
    NVML_NVLINK_MAX_LINKS = 18

    def __init__(self, pci, links):
        self.pci, self.links = pci, links  # links: {(gpu, link): remote PCI bus id}

    def nvmlInit(self):
        pass

    nvmlShutdown = nvmlInit

    def nvmlDeviceGetCount(self):
        return len(self.pci)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetPciInfo(self, h):
        return type("Pci", (), {"busId": self.pci[h]})

    def nvmlDeviceGetNvLinkState(self, h, link):
        if (h, link) not in self.links:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return 1

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h, link):
        return type("Pci", (), {"busId": self.links[(h, link)]})

    def nvmlDeviceGetTopologyCommonAncestor(self, a, b):
        return 40  # NODE


def test_nvml_topology_direct_links_and_nvswitch(monkeypatch):
    from multigpu.doctor.topology import nvml_topology

    pci = ["0000:01:00.0", "0000:02:00.0", "0000:03:00.0"]
    direct = {(0, 0): pci[1], (0, 1): pci[1], (1, 0): pci[0], (1, 1): pci[0]}
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(pci, direct))
    t = nvml_topology()
    assert t.links[("GPU0", "GPU1")] == "NV2" and t.links[("GPU0", "GPU2")] == "NODE" and t.source == "NVML"
    # HGX/DGX: every GPU's links end on NVSwitches, not on another GPU.
    switched = {(g, link): f"0000:a{link % 4}:00.0" for g in range(2) for link in range(18)}
    monkeypatch.setitem(sys.modules, "pynvml", _FakeNvml(pci[:2], switched))
    t = nvml_topology()
    assert t.nvlink and t.links[("GPU1", "GPU0")] == "NV18"


# -- the rule table: each bad variable on the machine it hurts ----------------------------


def test_p2p_disable_depends_on_topology():
    assert one({"NCCL_P2P_DISABLE": "1"}, Facts(nvlink=True)).status == "problem"
    assert one({"NCCL_P2P_DISABLE": "1"}, Facts(nvlink=False)).status == "warning"
    # The case it exists for: P2P returns wrong data here.
    justified = one({"NCCL_P2P_DISABLE": "1"}, Facts(nvlink=False, p2p_broken=True))
    assert justified.status == "ok" and "wrong data" in justified.what
    assert one({"NCCL_P2P_DISABLE": "0"}, Facts(nvlink=True)).status == "ok"


def test_ib_disable_depends_on_ib_devices():
    bad = one({"NCCL_IB_DISABLE": "1"}, Facts(ib_devices=IB))
    assert bad.status == "problem" and "TCP" in bad.what and bad.fix == "unset NCCL_IB_DISABLE"
    assert one({"NCCL_IB_DISABLE": "1"}, Facts(ib_devices=())).status == "warning"


def test_socket_ifname_patterns():
    facts = Facts(interfaces=IFACES)
    tutorial = one({"NCCL_SOCKET_IFNAME": "^docker0"}, facts)
    assert tutorial.status == "problem" and "lets lo through" in tutorial.what and "^docker,lo" in tutorial.fix
    assert one({"NCCL_SOCKET_IFNAME": "^docker,lo"}, facts).status == "ok"
    assert one({"NCCL_SOCKET_IFNAME": "=eth0"}, facts).status == "ok"
    nothing = one({"NCCL_SOCKET_IFNAME": "ib"}, facts)
    assert nothing.status == "problem" and "matches none" in nothing.what and "eth0" in nothing.fix
    assert one({"NCCL_SOCKET_IFNAME": "=eth"}, facts).status == "problem"  # '=' means the exact name
    assert one({"NCCL_SOCKET_IFNAME": "lo"}, facts).status == "warning"
    assert one({"NCCL_SOCKET_IFNAME": "en"}, Facts(interfaces=("lo", "enp1s0f0"))).what.endswith("selects enp1s0f0")


def test_filter_syntax():
    assert parse_filter("^=docker0,lo") == (True, True, ["docker0", "lo"])
    assert filter_admits("eth", "eth10") and not filter_admits("=eth1", "eth10")
    assert filter_admits("^docker", "eth0") and not filter_admits("^docker", "docker0")
    assert filter_admits("mlx5_0:1", "mlx5_0")


def test_ib_hca_prefix_match():
    facts = Facts(ib_devices=IB)
    prefix = one({"NCCL_IB_HCA": "mlx5_1"}, facts)
    assert prefix.status == "warning" and "mlx5_10, mlx5_11" in prefix.what and "NCCL_IB_HCA='=mlx5_1'" in prefix.fix
    assert one({"NCCL_IB_HCA": "=mlx5_1"}, facts).status == "ok"
    assert one({"NCCL_IB_HCA": "mlx5_0:1,mlx5_1:1"}, Facts(ib_devices=("mlx5_0", "mlx5_1"))).status == "ok"
    assert "also excludes" in one({"NCCL_IB_HCA": "^mlx5_1"}, facts).what
    assert one({"NCCL_IB_HCA": "mlx5_9"}, facts).status == "problem"
    assert one({"NCCL_IB_HCA": "mlx5_0"}, Facts()).status == "warning"


def test_forced_protocol_and_algorithm():
    assert one({"NCCL_PROTO": "LL128"}).status == "problem"
    assert one({"NCCL_PROTO": "Simple"}).status == "warning"
    assert one({"NCCL_PROTO": "^LL128"}).status == "warning"
    assert one({"NCCL_PROTO": "fast"}).status == "problem"
    assert one({"NCCL_ALGO": "Ring"}).status == "warning"
    assert one({"NCCL_ALGO": "allreduce:tree;allgather:ring"}).status == "warning"
    bad = one({"NCCL_ALGO": "ring,hypercube"})
    assert bad.status == "problem" and "hypercube" in bad.what


def test_nonexistent_deprecated_debug_unknown():
    t = one({"NCCL_TIMEOUT": "1800"})
    assert t.status == "warning" and "does not exist" in t.what and "init_process_group" in t.fix
    d = one({"NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert "deprecated" in d.what and d.fix == "rename it to TORCH_NCCL_ASYNC_ERROR_HANDLING" and "PyTorch" in d.source
    assert one({"NCCL_MAX_NRINGS": "4"}).fix.startswith("rename it to NCCL_MAX_NCHANNELS")
    b = one({"NCCL_BUFFSIZE": "8388608"})
    assert b.status == "warning" and "debugging" in b.what
    u = one({"NCCL_SOCKET_IFNAMES": "eth0"})
    assert u.status == "warning" and "unknown" in u.what
    assert "unknown" in one({"TORCH_NCCL_MADE_UP": "1"}).what
    assert one({"NCCL_IB_TIMEOUT": "22"}).status == "ok"
    assert one({"NCCL_DEBUG": "WARN"}).status == "ok" and one({"NCCL_DEBUG": "INFO"}).status == "warning"


def test_torch_variables():
    assert one({"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}).status == "warning"
    assert one({"TORCH_DISTRIBUTED_DEBUG": "INFO"}).status == "ok"
    assert one({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "0"}).status == "warning"
    assert one({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"}).status == "ok"
    assert one({"TORCH_NCCL_BLOCKING_WAIT": "1"}).status == "warning"
    assert one({"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000"}).status == "ok"


def test_every_rule_has_reason_fix_and_source():
    names = [*DEBUG, *DEPRECATED, *NONEXISTENT, *KNOWN_TORCH, "NCCL_SOCKET_IFNAME", "NCCL_IB_HCA", "NCCL_ALGO"]
    for name in names:
        f = lint_variable(name, "1", Facts(nvlink=True, ib_devices=IB, interfaces=IFACES))
        assert f.source and ("NVIDIA NCCL" in f.source or "PyTorch" in f.source), (name, f)
        assert f.check == "environment"
        if f.status != "ok":
            assert f.fix, (name, f)


def test_unrelated_variables_are_ignored_and_empty_env_is_ok():
    assert one({"PATH": "/usr/bin", "CUDA_VISIBLE_DEVICES": "0"}).status == "ok"
    found = lint_env({"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "1", "HOME": "/root"}, Facts(nvlink=True))
    assert [f.status for f in found] == ["ok", "problem"]


def test_conf_files_are_read_and_environment_wins():
    conf = "# site settings\nNCCL_P2P_DISABLE=1\nNCCL_DEBUG = INFO  # noisy\n\n"
    values, origins = merge_env({"NCCL_DEBUG": "WARN"}, [("/etc/nccl.conf", conf)])
    assert values == {"NCCL_DEBUG": "WARN", "NCCL_P2P_DISABLE": "1"}
    found = lint_env(values, Facts(nvlink=True), origins)
    assert found[1].status == "problem" and found[1].what.endswith("(from /etc/nccl.conf)")


def test_doctor_reads_nccl_conf_file(tmp_path):
    conf = tmp_path / "nccl.conf"
    conf.write_text("NCCL_PROTO=LL128\nNCCL_DEBUG=WARN\n")
    found = run_doctor(smoke=False, environ={"NCCL_CONF_FILE": str(conf), "NCCL_DEBUG": "INFO"})
    env = {f.what.split("=")[0]: f for f in found if f.check == "environment"}
    assert env["NCCL_PROTO"].status == "problem" and env["NCCL_PROTO"].what.endswith(f"(from {conf})")
    assert env["NCCL_DEBUG"].what.startswith("NCCL_DEBUG=INFO")  # the environment wins over the file
    assert env["NCCL_CONF_FILE"].status == "ok"


# -- versions, devices, host -----------------------------------------------------------------


def test_versions():
    cpu_build_on_gpu_box = Versions("3.11.7", "2.7.0+cpu", True, {"nccl": False, "gloo": True, "mpi": False},
                                    None, False, "550.54", "12.4", 8)
    found = check_versions(cpu_build_on_gpu_box)
    assert sum(f.status == "problem" for f in found) == 2
    old_driver = Versions("3.11.7", "2.7.0", True, {"nccl": True, "gloo": True, "mpi": False}, "12.8", True,
                          "535.1", "12.2", 8, "2.26.2", "90100")
    found = check_versions(old_driver)
    assert worst(found) == "warning" and any("update the NVIDIA driver" == f.fix for f in found)
    assert any("NCCL 2.26.2" in f.what for f in found)
    assert worst(check_versions(Versions("3.11.7", "2.7.0", True, {"nccl": False, "gloo": True, "mpi": False}))) == "ok"


def test_collect_versions_reads_this_torch():
    import torch

    from multigpu.doctor.checks import collect_versions

    v = collect_versions()
    assert v.torch == torch.__version__ and v.distributed and v.backends["gloo"]
    assert v.cuda_available == torch.cuda.is_available() and v.cuda_runtime == torch.version.cuda


def test_p2p_and_mixed_gpus():
    found = check_p2p({(0, 1): (True, False), (1, 0): (True, True), (0, 2): (False, None)})
    assert [f.status for f in found] == ["problem", "warning", "ok"]
    assert "NCCL_P2P_DISABLE=1" in found[0].fix
    mixed = check_devices([Gpu(0, "A100", 80 * 2**30, (8, 0)), Gpu(1, "V100", 32 * 2**30, (7, 0))], None)
    assert [f.status for f in mixed].count("warning") == 2  # mixed models, unknown topology


def test_host_checks():
    assert check_shm(64 * 2**20, gpus=8)[0].status == "problem"
    assert check_shm(64 * 2**20, gpus=0)[0].status == "warning"
    assert check_shm(16 * 2**30, gpus=8)[0].status == "ok"
    assert check_shm(None, gpus=1)[0].status == "warning"
    low = check_nofile(1024, 4096)[0]
    assert low.status == "warning" and low.fix == "ulimit -n 4096"
    assert check_nofile(65536, 65536)[0].status == "ok"
    assert check_interfaces([Iface("lo", True, ("127.0.0.1",)), Iface("eth0", False)])[0].status == "warning"
    assert check_interfaces([Iface("lo", True), Iface("eth0", True, ("10.0.0.2",))])[0].status == "ok"
    assert check_port(29500, "Address already in use")[0].status == "problem"


def test_port_probe_sees_a_listener():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_in_use(s.getsockname()[1])
    with socket.socket() as s:
        s.bind(("", 0))
        free = s.getsockname()[1]
    assert port_in_use(free) is None


def test_secrets_are_never_printed():
    env = {"WANDB_API_KEY": "abc123verysecret", "HF_TOKEN": "hf_abcdefghijklmnop", "NCCL_MADE_UP": "sk-0123456789abcdefXYZ"}
    assert redact("WANDB_API_KEY", "abc123verysecret") == REDACTED
    found = check_secrets(env) + lint_env(env, Facts())
    text = format_findings(found) + json.dumps([f.to_dict() for f in found])
    assert "WANDB_API_KEY" in text and "abc123verysecret" not in text
    assert "hf_abcdefghijklmnop" not in text and "sk-0123456789abcdefXYZ" not in text
    # The whole doctor (real collectors, fabricated environment) never prints them either.
    full = run_doctor(smoke=False, environ=env | {"PATH": os.environ.get("PATH", "")})
    assert "abc123verysecret" not in json.dumps([f.to_dict() for f in full]) + format_findings(full)


def test_a_crashing_collector_becomes_a_problem(monkeypatch):
    from multigpu.doctor import checks

    def broken():
        raise RuntimeError("CUDA error: unknown error\nCUDA kernel errors might be reported asynchronously")

    monkeypatch.setattr(checks, "collect_gpus", broken)
    found = run_doctor(smoke=False, environ={})
    bad = [f for f in found if f.status == "problem"]
    assert len(bad) == 1 and bad[0].check == "devices" and "RuntimeError: CUDA error: unknown error CUDA kernel" in bad[0].what
    assert any(f.check == "host" for f in found)  # the other checks still ran


def test_likely_causes():
    assert "firewall" in likely_cause("torch.distributed.DistStoreError: Timed out after 30 seconds")
    assert "port" in likely_cause("RuntimeError: Address already in use")
    assert "NCCL_SOCKET_IFNAME" in likely_cause("NCCL WARN Bootstrap : no socket interface found")
    assert "P2P" in likely_cause("all_reduce returned wrong values on rank 1")
    assert "NCCL_DEBUG=INFO" in likely_cause("something nobody has seen")


# -- live runs -----------------------------------------------------------------------------


def test_doctor_cli_port_taken_and_smoke_test_on_two_cpu_ranks():
    """One CLI run: the 2-rank gloo smoke test passes, the taken port is the one problem, exit 1, JSON out."""
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_"))}
        proc = subprocess.run([sys.executable, "-m", "multigpu", "doctor", "-n", "2", "--backend", "gloo", "--port", str(port),
                               "--json", "--timeout", "60"], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 1, proc.stderr
    report = json.loads(proc.stdout)
    problems = [f for f in report["findings"] if f["status"] == "problem"]
    assert len(problems) == 1 and f"port {port} is in use" in problems[0]["what"], problems
    smoke = [f for f in report["findings"] if f["check"] == "smoke test"]
    assert len(smoke) == 1 and smoke[0]["status"] == "ok" and "2 ranks over gloo" in smoke[0]["what"]
    assert "all_reduce correct" in smoke[0]["what"]
    assert report["exit_status"] == 1 and report["status"] == "problem"


def test_smoke_failure_reports_the_rank_and_cause():
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA for a deterministic failure")
    found = run_smoke(2, backend="nccl", timeout=30)
    assert len(found) == 1 and found[0].status == "problem"
    assert "failed" in found[0].what and "needs a CUDA GPU" in found[0].what
    assert "--backend gloo" in found[0].fix


@pytest.mark.parametrize("argv", [["doctor", "-n", "0"], ["doctor", "--port", "70000"], ["doctor", "--timeout", "0"],
                                  ["doctor", "-n", "x"]])
def test_doctor_usage_errors(argv, capsys):
    code, err = run_cli(argv, capsys)
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err


@pytest.mark.gpu
def test_doctor_on_gpus():
    import torch

    found = run_doctor(nproc=torch.cuda.device_count(), smoke=True)
    assert any(f.check == "devices" and "compute capability" in f.what for f in found)
    smoke = [f for f in found if f.check == "smoke test"]
    assert smoke and smoke[0].status == "ok", smoke
    if torch.cuda.device_count() > 1:
        from multigpu.doctor.checks import collect_p2p

        p2p = collect_p2p(torch.cuda.device_count())
        assert len(p2p) == torch.cuda.device_count() * (torch.cuda.device_count() - 1)
        assert all(ok is not False for _, ok in p2p.values()), p2p

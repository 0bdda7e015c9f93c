import os
import pathlib
import sys

import pytest

SRC = str(pathlib.Path(__file__).resolve().parents[1] / "src")
TESTS = str(pathlib.Path(__file__).resolve().parent)
# Worker processes (spawn, launcher) must import this checkout's package and
# the test modules whose functions they run.
os.environ["PYTHONPATH"] = os.pathsep.join([SRC, TESTS, *filter(None, [os.environ.get("PYTHONPATH")])])
if SRC not in sys.path:
    sys.path.insert(0, SRC)
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _one_loop_round(monkeypatch):
    """tune's loop probe launches the script 3 times per micro-batch count to outvote a slow phase of a shared
    machine (``probe.LOOP_ROUNDS``); the tests that run tune check its plumbing, so one round each keeps the
    suite's time (the medians' arithmetic has its own test: ``test_the_loop_probe_differences_each_round...``)."""
    from multigpu.tune import probe

    monkeypatch.setattr(probe, "LOOP_ROUNDS", 1)

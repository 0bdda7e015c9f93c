"""The built-in demo reaches >= 95 % on 1 process and on 2 gloo ranks, with the same result."""

import pytest

from multigpu.recipes import digits
from multigpu.testing import spawn


def _run_digits(dist, argv):
    return digits.main(argv)


def test_digits_reaches_95_percent_on_1_and_2_ranks_alike(monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    one = digits.main(["--epochs", "12", "--log-dir", str(tmp_path / "one")])
    two = spawn(_run_digits, 2, ["--epochs", "12", "--log-dir", str(tmp_path / "two")])
    assert one["accuracy"] >= 0.95
    assert two[0]["accuracy"] >= 0.95
    assert two[0] == {**two[1], "samples_per_s": two[0]["samples_per_s"], "wall_s": two[0]["wall_s"]}
    # Same global batches on 1 and 2 ranks: the same model up to float summation order.
    assert abs(one["accuracy"] - two[0]["accuracy"]) <= 1 / 360 + 1e-9
    assert one["count"] == two[0]["count"] == 360


def test_digits_bad_strategy_is_one_line_exit_2(capfd, monkeypatch, tmp_path):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        digits.main(["--strategy", "nope", "--epochs", "1", "--log-dir", str(tmp_path)])
    assert exc.value.code == 2
    err = capfd.readouterr().err.strip()
    assert err.count("\n") == 0
    assert err.startswith("multigpu: error: unknown strategy 'nope'; expected one of none, dp, ddp")

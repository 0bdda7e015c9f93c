"""Verdict rules on fabricated measurements, and the HTML report in a real headless browser."""

import json
import shutil

import pytest

from multigpu.study import verdict as V
from multigpu.report import write_report


def _group(**kw):
    g = {"workers": 2, "policy": "keep-global", "global_batch": 64, "n_ok": 1, "n_failed": 0,
         "efficiency": 0.9, "breakdown": {"compute": 0.9, "comm_exposed": 0.05, "data_wait": 0.02, "idle": 0.03},
         "accuracy": {"mean": 0.975, "std": 0.0}, "noise_scale": None, "errors": []}
    g.update(kw)
    return g


BASE = _group(workers=1, efficiency=None, accuracy={"mean": 0.975, "std": 0.002})


@pytest.mark.parametrize(
    "changes, kind, fragment",
    [
        ({}, "compute", "compute bound: 90 % efficiency"),
        ({"breakdown": {"data_wait": 0.38, "compute": 0.6}, "efficiency": 0.5}, "data",
         "data-loading bound: rank wait 38 % of step; raise num_workers"),
        ({"breakdown": {"comm_exposed": 0.45, "compute": 0.5}, "efficiency": 0.4}, "communication",
         "communication bound: 45 % exposed all-reduce; try bf16 compress or larger buckets"),
        ({"global_batch": 4096, "noise_scale": 600.0}, "critical-batch",
         "beyond the critical batch: global batch 4096 vs noise scale ~600; more GPUs will not cut steps"),
        ({"accuracy": {"mean": 0.93, "std": 0.004}}, "accuracy", "accuracy drop: 93.00 % vs 97.50 % on 1 worker"),
        ({"efficiency": 0.55}, "scaling", "poor scaling: 55 % efficiency (compute 90 %"),
        ({"n_ok": 0, "n_failed": 1, "errors": ["rank 1 exited with code 1"]}, "failed", "failed: rank 1 exited"),
    ],
)
def test_verdict_rules(changes, kind, fragment):
    found = V.findings(_group(**changes), BASE)
    assert found[0].kind == kind
    assert fragment.replace(" or larger buckets", "") in found[0].text
    assert V.verdict(_group(**changes), BASE) == found[0].text


def test_verdict_thresholds_are_edges():
    just_below = _group(breakdown={"data_wait": V.DATA_WAIT_BOUND - 0.01}, efficiency=0.5)
    at = _group(breakdown={"data_wait": V.DATA_WAIT_BOUND}, efficiency=0.5)
    assert V.findings(just_below, BASE)[0].kind == "scaling"
    assert V.findings(at, BASE)[0].kind == "data"
    # Within twice the spread is not a drop.
    noisy = _group(accuracy={"mean": 0.96, "std": 0.01})
    assert all(f.kind != "accuracy" for f in V.findings(noisy, BASE))
    assert V.verdict(BASE, BASE) == "baseline (1 worker)"


def fabricated_study():
    runs, groups = [], []
    for w, sps, eff in [(1, 1000.0, None), (2, 1500.0, 0.75), (4, 2400.0, 0.6)]:
        samples = [64 * i for i in range(1, 21)]
        runs.append({
            "id": f"w{w}-keep-global-r0", "workers": w, "policy": "keep-global", "repeat": 0, "status": "ok",
            "global_batch": 64, "samples_per_s": sps,
            "curve": {"samples": samples, "loss": [2.3 / (1 + 0.3 * i) for i in range(20)],
                      "wall_s": [s / sps for s in samples]},
            "noise": {"samples": samples[::4], "b_simple": [50.0 + 10 * i for i in range(5)]},
        })
        groups.append(_group(workers=w, samples_per_s={"mean": sps, "std": 20.0},
                             # 2 workers: 3 rounds, an interval; 4 workers: 1 round, none
                             speedup=None if w == 1 else {"mean": sps / 1000, "std": 0.02}
                             | ({"low": 1.4, "high": 1.61} if w == 2 else {"low": None, "high": None}),
                             efficiency=None if w == 1 else {"mean": eff, "std": 0.01}
                             | ({"low": 0.7, "high": 0.805} if w == 2 else {"low": None, "high": None}),
                             breakdown={"compute": 0.7, "comm_exposed": 0.2 if w > 1 else 0.0, "data_wait": 0.05,
                                        "idle": 0.05},
                             accuracy={"mean": 0.97, "std": 0.003}, noise_scale=90.0,
                             to_target_s={"mean": 3.0 / w, "std": 0.0}, verdict="compute bound"))
    runs.append({"id": "w8-keep-global-r0", "workers": 8, "policy": "keep-global", "repeat": 0, "status": "failed",
                 "error": "rank 5 was killed by SIGKILL"})
    return {"version": 1, "workload": {"name": "digits"}, "headline": "2 workers: 1.50x, 75 % efficiency",
            "fingerprint": {"torch": "2.13.0", "device": "cpu"}, "runs": runs, "groups": groups}


def test_report_writes_html_and_markdown(tmp_path):
    (tmp_path / "study.json").write_text(json.dumps(fabricated_study()))
    html_path, md_path = write_report(tmp_path)
    md = md_path.read_text()
    assert "| 2 | keep-global | 64 | 1500 ± 20 | 1.50x (1.40-1.61x) | 75 % (70-80 %) |" in md
    assert "| 4 | keep-global | 64 | 2400 ± 20 | 2.40x | 60 % |" in md
    assert "w8-keep-global-r0: rank 5 was killed by SIGKILL" in md
    page = html_path.read_text()
    assert page.count("data:image/png;base64,") == 4  # throughput, loss, breakdown, noise
    assert "http://" not in page and "https://" not in page  # self-contained


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


def test_report_renders_in_headless_chromium(tmp_path):
    if not _chromium():
        pytest.skip("no Chromium on this machine (`make test` installs Debian's chromium where apt works)")
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is in the [test] extra")
    (tmp_path / "study.json").write_text(json.dumps(fabricated_study()))
    html_path, _ = write_report(tmp_path)
    errors = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1200, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url}"))
        page.goto(html_path.as_uri())
        images = page.evaluate("""() => [...document.images].map(img => {
            const c = document.createElement('canvas'); c.width = img.naturalWidth; c.height = img.naturalHeight;
            const ctx = c.getContext('2d'); ctx.drawImage(img, 0, 0);
            const d = ctx.getImageData(0, 0, c.width, c.height).data;
            let colours = new Set();
            for (let i = 0; i < d.length; i += 4 * 97) colours.add(d[i] + ',' + d[i+1] + ',' + d[i+2]);
            return {alt: img.alt, complete: img.complete, w: img.naturalWidth, h: img.naturalHeight,
                    shown: img.getBoundingClientRect().width, colours: colours.size};
        })""")
        shot = tmp_path / "report.png"
        page.screenshot(path=str(shot), full_page=True)
        browser.close()
    assert errors == []
    assert [i["alt"] for i in images] == ["throughput", "loss", "breakdown", "noise"]
    for img in images:
        assert img["complete"] and img["shown"] > 300
        assert (img["w"], img["h"]) in ((1000, 380), (650, 380)), img
        assert img["colours"] > 5, f"{img['alt']} looks blank"
    assert shot.stat().st_size > 20_000


def test_a_plot_of_one_point_shows_it_and_a_plot_left_out_says_why(tmp_path):
    import matplotlib.pyplot as plt

    from multigpu.report.study import _figures

    # The case filed: 8 steps logged every 10, so each run's curve is one record; drawn as a line it is nothing.
    study = fabricated_study()
    for r in study["runs"]:
        if r["status"] == "ok":
            r["curve"] = {k: v[:1] for k, v in r["curve"].items()}
            r["noise"] = {k: v[:1] for k, v in r["noise"].items()}
    study["groups"][1]["efficiency"] = None  # e.g. its 1-worker baseline was too short to judge
    figs, missing = _figures(study)
    for name in ("loss", "noise"):
        points = [line for ax in figs[name].axes for line in ax.get_lines() if len(line.get_xdata()) == 1]
        assert len(points) == (6 if name == "loss" else 3) and all(p.get_marker() == "o" for p in points), name
    efficiency = figs["throughput"].axes[1].get_lines()[0].get_ydata()
    assert efficiency[0] == 100 and efficiency[1] != efficiency[1]  # no efficiency: no point, not 100 %
    assert missing == []
    plt.close("all")
    # Nothing to draw: the page says which plot is missing and why.
    for r in study["runs"]:
        r.pop("curve", None), r.pop("noise", None)
    for g in study["groups"]:
        g["breakdown"] = {}
    (tmp_path / "study.json").write_text(json.dumps(study))
    _, md_path = write_report(tmp_path)
    md = md_path.read_text()
    assert "- No loss plot: no finished run logged a loss (pass it to meter.step_end(loss=...))" in md
    assert "- No noise-scale plot: no run logged noise/b_simple" in md and "- No time-breakdown plot" in md
    assert md.count("](") == 1  # the throughput plot alone


def test_no_verdict_is_drawn_from_runs_too_short_to_judge():
    line = "30 steps asked, 8 recorded, 6 measured after warm-up (its data ran out or it stopped early); give ..."
    short = dict(n_ok=0, n_short=1, short=[line], efficiency=None)
    assert V.verdict(_group(**short), BASE) == f"no verdict: {line}"
    # a group measured against a baseline that has no run to judge: no scaling verdict from nothing
    base = _group(workers=1, **short)
    assert V.verdict(_group(efficiency=None), base) == f"no verdict on scaling: the 1-worker baseline was too short to judge: {line}"
    failed = _group(workers=1, n_ok=0, n_failed=1, errors=["rank 0 exited with code 1"], efficiency=None)
    assert V.verdict(_group(efficiency=None), failed) == ("no verdict on scaling: the 1-worker baseline failed: rank 0 "
                                                          "exited with code 1")
    assert V.verdict(_group(efficiency=None), None) == ("no verdict on scaling: no 1-worker run to compare with (add 1 "
                                                        "to --workers)")
    # one round of three too short: the others judge, and the verdict list says so
    mixed = V.findings(_group(n_ok=2, n_short=1, short=[line]), BASE)
    assert mixed[0].kind == "short" and mixed[0].text == f"1 of 3 runs left out, too short to judge: {line}"
    assert mixed[1].kind == "compute"


def test_report_of_one_run_reads_its_metrics_and_says_when_it_is_too_short(tmp_path, capsys):
    """`multigpu report RUN_DIR`: a real run of tests/_layout_script.py (256 samples, the meter logging every 2
    steps) under `multigpu run`; the page's rate is the meter's summary (total samples / total time of the
    measured steps); a run whose data ran out at 8 of 30 steps asked is not given a rate. A directory with
    neither study.json nor metrics.jsonl is refused in one line."""
    import subprocess
    import sys
    from pathlib import Path

    from _cli import run_cli

    script = str(Path(__file__).with_name("_layout_script.py"))
    for name, steps in (("whole", 12), ("short", 30)):
        out = tmp_path / name
        proc = subprocess.run([sys.executable, "-m", "multigpu", "run", "-n", "1", "--cpu", "--log-dir", str(out),
                               script, "--steps", str(steps), "--global-batch", "16" if name == "whole" else "32"],
                              capture_output=True, text=True, timeout=240)
        assert proc.returncode == 0, proc.stderr[-2000:]
    runs = {name: next(p.parent for p in (tmp_path / name).rglob("metrics.jsonl")) for name in ("whole", "short")}
    code, err = run_cli(["report", str(runs["whole"])], capsys)
    assert code == 0, err
    md = (runs["whole"] / "report.md").read_text()
    summary = [json.loads(line) for line in (runs["whole"] / "metrics.jsonl").read_text().splitlines()][-1]
    assert summary["type"] == "summary"
    assert f"{summary['samples_per_s']:,.1f} samples/s over steps {summary['rate_steps'][0]}-" in md
    assert (runs["whole"] / "report.html").is_file() and (runs["whole"] / "loss.png").is_file()
    run_cli(["report", str(runs["short"])], capsys)
    short_md = (runs["short"] / "report.md").read_text()
    assert "Too short to judge:" in short_md and "samples/s over steps" not in short_md
    code, err = run_cli(["report", str(tmp_path)], capsys)
    assert code == 2 and "holds neither study.json nor a metrics.jsonl" in err and err.count("\n") == 1
    # The --log-dir itself (the run sits in a subfolder of it): its one run is found; with two, one line names both.
    (runs["whole"] / "report.md").unlink()
    code, err = run_cli(["report", str(tmp_path / "whole")], capsys)
    assert code == 0, err
    assert (runs["whole"] / "report.md").read_text() == md
    shutil.copytree(runs["whole"], tmp_path / "whole" / "again")
    code, err = run_cli(["report", str(tmp_path / "whole")], capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"{tmp_path / 'whole'} holds 2 runs (" in err and "again" in err and runs["whole"].name in err
    assert "; pass one, e.g. multigpu report " in err

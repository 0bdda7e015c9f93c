"""Predicted vs published for every row of src/multigpu/forecast/tables/published.json: the tables of
docs/forecast.md (fitted rows marked, and rows whose layout multigpu does not run; every other row held out), then
the summary and the pairs.

    PYTHONPATH=src python benchmarks/forecast_published.py [--refit]

--refit solves the calibration's constants on its named rows again and reports with those (the stored
ones are what tests/test_forecast.py checks it reproduces).
"""

from __future__ import annotations

import argparse

from multigpu.forecast import published


def pct(x):
    return "" if x is None else f"{100 * x:+.0f} %"


def cells(s: dict, kind: str, bound: int) -> str:
    """A summary's rows, share within ``bound`` %, median and worst error, as table cells."""
    if not s[f"{kind}_rows"]:
        return "0 | | | "
    return (f"{s[kind + '_rows']} | {s[f'{kind}_within_{bound}']:.0%} | {s[kind + '_median']:.1%} | "
            f"{s[kind + '_worst']:.1%}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--refit", action="store_true")
    if parser.parse_args().refit:
        a = published.fit()
        result = published.check(a, published.fit_by_gpu(a))
    else:
        result = published.check()
    print("| row | published tokens/s/GPU (MFU) | predicted | error | published GiB (kind) | predicted GiB | error | "
          "predicted allocated GiB |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for e in result["rows"]:
        r = e["row"]
        pub = f"{r['tokens_per_s_per_gpu']:,}" if r["tokens_per_s_per_gpu"] else f"({100 * r['mfu']:.0f} % MFU)"
        pred = f"{e['predicted_tokens']:,.0f}" if r["tokens_per_s_per_gpu"] else f"({100 * e['predicted_mfu']:.0f} % MFU)"
        mem = "" if r["peak_memory_gib"] is None else f"{r['peak_memory_gib']} ({r.get('memory_kind', 'unstated')})"
        pmem = "" if r["peak_memory_gib"] is None else f"{e['predicted_memory_gib']:.1f}"
        alloc = "" if r["peak_memory_gib"] is None else f"{e['predicted_allocated_gib']:.1f}"
        mark = ("**fitted** " if e["fitted"] else "") + ("**outside multigpu's layouts** " if e["outside"] else "")
        print(f"| {mark}{e['key']} | {pub} | {pred} | {pct(e['tokens_error'])} | {mem} | "
              f"{pmem} | {pct(e['memory_error'])} | {alloc} |")
    for part in ("held_out", "fitted", "unseen_sources"):
        s = result[part]
        print(f"\n{part}: speed rows {s['tokens_rows']}, within 25 %: {s['tokens_within_25']:.0%}, median "
              f"{s['tokens_median']:.1%}, worst {s['tokens_worst']:.1%}; memory rows {s['memory_rows']}, within 15 %: "
              f"{s['memory_within_15']:.0%}, median {s['memory_median']:.1%}, worst {s['memory_worst']:.1%}")
    print("\n| source (held-out rows) | speed rows | within 25 % | median | worst | memory rows | within 15 % | median | worst |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in result["by_source"].items():
        print(f"| {name} | {cells(s, 'tokens', 25)} | {cells(s, 'memory', 15)} |")
    p = result["pairs"]
    print(f"\npairs (held out): {p['ranked_right']} of {p['count']} ranked right")
    for pair in p["pairs"]:
        if not pair["ranked_right"]:
            print(f"  wrong: published faster {pair['faster']}  vs  {pair['slower']}")
    print(f"\nassumptions: {result['assumptions']}; each GPU kind's own efficiency: {result['by_gpu']}")
    loso = published.leave_one_source_out()
    print("\n| source left out (constants fitted on the others) | speed rows | within 25 % | median | worst | "
          "memory rows | within 15 % | median | worst | pairs right | efficiency (its GPUs) | compile | fp8 | allocator |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, fold in [*loso["by_source"].items(), ("**every source, each left out once**", loso)]:
        s = fold.get("summary", fold.get("overall"))
        gpus = {r["gpu"] for r in published.rows() if published.source(r) == name} or {"all"}
        eff = ", ".join(f"{g} {fold['efficiency'][g]:.3f}" if g in fold["efficiency"] else
                        f"{g} {fold['shared_efficiency']:.3f} (shared)" for g in sorted(gpus)) if "efficiency" in fold else ""
        const = " | ".join(f"{fold[f]:.3f}" if f in fold else "" for f in ("compile_speedup", "fp8_speedup", "allocator_overhead"))
        pairs = fold["pairs"]
        print(f"| {name} | {cells(s, 'tokens', 25)} | {cells(s, 'memory', 15)} | "
              f"{pairs['ranked_right']} of {pairs['count']} | {eff} | {const} |")


if __name__ == "__main__":
    main()

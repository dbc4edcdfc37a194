#!/usr/bin/env python3
"""Figures of one tools/device_int8_diet_check.sh result dir (OLD vs NEW int8 expert kernel).

Usage: tools/device_int8_diet_summary.py RESULT_DIR [--json]
Prints: the unit tests' result, NEW against OLD's dump at 16 and 256 tokens (largest |diff| over
all modules), the interleaved --bench rounds, and the expert launches (glmcheck_q8mm) under ncu:
OLD's at 256 tokens against NEW's, per forward (the census runs two forwards: the captured one
and the timed one, so totals are halved), with registers per thread.
"""
import csv
import io
import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def ncu_rows(path):
    lines = [l for l in path.read_text(errors="replace").splitlines(True) if l.startswith('"')]
    return list(csv.DictReader(io.StringIO("".join(lines))))


def experts(path):
    """{kernel: [launches, µs, registers]} of the glmcheck_q8mm launches in an ncu census."""
    out = defaultdict(lambda: [0, 0.0, set()])
    for r in ncu_rows(path):
        name = r["Kernel Name"].split("(")[0].replace("void <unnamed>::", "")
        if "glmcheck_q8mm" not in name:
            continue
        v = r["Metric Value"].replace(",", "")
        if r["Metric Name"] == "gpu__time_duration.sum":
            out[name][0] += 1
            out[name][1] += float(v) / 1e3
        elif r["Metric Name"] == "launch__registers_per_thread":
            out[name][2].add(int(v))
    return out


def main():
    d = Path(sys.argv[1])
    if (d / "diet").is_dir():
        d = d / "diet"
    res = {"gpu": (d / "gpu.txt").read_text().strip(), "commit": (d / "commit.txt").read_text().strip()}
    unit = (d / "unit.log").read_text(errors="replace") + (d / "unit.json").read_text(errors="replace")
    res["unit"] = re.findall(r"test result: \w+\. \d+ passed; \d+ failed", unit)
    res["new_vs_old_max_abs"] = {}
    for n in (16, 256):
        j = json.loads((d / f"new-vs-old-{n}.json").read_text())
        mods = j["modules"]
        res["new_vs_old_max_abs"][n] = {"modules": len(mods), "max_abs": max(m["max_abs"] or 0 for m in mods)}
    res["bench_best_ms"] = {}
    for v in ("old", "new"):
        for n in (16, 256):
            xs = []
            for f in sorted(d.glob(f"{v}-{n}-r*.json")):
                xs.append(round(json.loads(f.read_text())["bench"]["best_ms"], 2))
            res["bench_best_ms"][f"{v}-{n}"] = xs
    res["experts_256_per_forward_us"] = {}
    for v, f in (("old", "census-old-experts-256.json"), ("new", "census-new-256.json")):
        e = experts(d / f)
        res["experts_256_per_forward_us"][v] = {
            k: {"launches": c // 2, "us": round(t / 2, 1), "registers": sorted(r)} for k, (c, t, r) in e.items()
        }
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
        return
    print(f"GPU {res['gpu']}; commit {res['commit']}")
    print("unit:", "; ".join(res["unit"]) or "no result line")
    for n, m in res["new_vs_old_max_abs"].items():
        print(f"NEW vs OLD at {n} tokens: {m['modules']} modules, max |diff| {m['max_abs']}")
    for k, xs in res["bench_best_ms"].items():
        print(f"best of 5, {k}: {' / '.join(map(str, xs))} (mean {sum(xs) / len(xs):.2f})")
    for v, ks in res["experts_256_per_forward_us"].items():
        tot = sum(k["us"] for k in ks.values())
        parts = ", ".join(f"{n} {k['launches']}× {k['us']:.0f} µs ({k['registers']} regs)" for n, k in ks.items())
        print(f"{v} experts at 256 tokens per forward: {tot:.0f} µs: {parts}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Figures of one tools/device_ab_check.sh result dir (OLD vs NEW build, same arithmetic expected).

Usage: tools/device_ab_summary.py RESULT_DIR [--json]
Prints: the unit tests' result lines, NEW against OLD's dump at 16 and 256 tokens (modules, largest
|diff|), the interleaved --bench rounds (best of 5 each), and the ncu census per forward (the census
runs two forwards, the captured one and the timed one, so counts and times are halved): kernels and
µs in all, and per kernel name, OLD against NEW at 256 tokens.
"""
import csv
import io
import json
import re
import sys
from collections import defaultdict
from pathlib import Path


def ncu_rows(path):
    if not path.exists():
        return []
    lines = [l for l in path.read_text(errors="replace").splitlines(True) if l.startswith('"')]
    return list(csv.DictReader(io.StringIO("".join(lines))))


def kernel(name):
    """A kernel's name without its arguments, namespace or template parameters; glmcheck's own
    kernels keep their template parameters (the int8 kernel's type and tile width tell the routed
    experts from the dense route's wide tiles)."""
    name = name.split("(")[0].replace("void ", "").replace("<unnamed>::", "").strip()
    if name.startswith("glmcheck_"):
        return re.sub(r"\s+", "", name)
    return re.sub(r"<.*", "", name).strip()


def census(path):
    """{kernel: [launches, µs]} per forward."""
    out = defaultdict(lambda: [0, 0.0])
    for r in ncu_rows(path):
        if r.get("Metric Name") != "gpu__time_duration.sum":
            continue
        k = kernel(r["Kernel Name"])
        out[k][0] += 1
        out[k][1] += float(r["Metric Value"].replace(",", "")) / 1e3
    return {k: [c / 2, round(t / 2, 1)] for k, (c, t) in out.items()}


def timed(path):
    """{kernel: [launches, µs]} of the last forward of a census: from the last embedding gather
    (`get_rows*`, the forward's first kernel) to the end; the bench's timed forward."""
    ks = [(kernel(r["Kernel Name"]), float(r["Metric Value"].replace(",", "")) / 1e3)
          for r in ncu_rows(path) if r.get("Metric Name") == "gpu__time_duration.sum"]
    starts = [i for i, (k, _) in enumerate(ks) if k.startswith("get_rows")]
    out = defaultdict(lambda: [0, 0.0])
    for k, t in ks[starts[-1]:] if starts else []:
        out[k][0] += 1
        out[k][1] += t
    return {k: [c, round(t, 1)] for k, (c, t) in out.items()}


def main():
    d = Path(sys.argv[1])
    subs = [p for p in d.iterdir() if p.is_dir() and (p / "rc.txt").exists()] if d.is_dir() else []
    if not (d / "rc.txt").exists() and len(subs) == 1:
        d = subs[0]
    res = {"gpu": (d / "gpu.txt").read_text().strip(), "commit": (d / "commit.txt").read_text().strip()}
    res["rc"] = (d / "rc.txt").read_text().split("\n") if (d / "rc.txt").exists() else []
    unit = ""
    for f in ("unit.log", "unit.json"):
        if (d / f).exists():
            unit += (d / f).read_text(errors="replace")
    res["unit"] = re.findall(r"test result: \w+\. \d+ passed; \d+ failed", unit)
    res["unit_failed"] = re.findall(r"^test (\S+) \.\.\. FAILED", unit, re.M)
    res["new_vs_old"] = {}
    for n in (16, 256):
        f = d / f"new-vs-old-{n}.json"
        try:
            fwd = json.loads(f.read_text())
            mods = fwd["modules"]
            # the verdict matters where the arithmetic may move (max_abs is then not 0 by design)
            res["new_vs_old"][n] = {"modules": len(mods), "max_abs": max(m["max_abs"] or 0 for m in mods),
                                    "verdict": fwd.get("verdict")}
        except (OSError, ValueError, KeyError) as e:
            res["new_vs_old"][n] = {"error": f"{f.name}: {e}"}
    res["bench_best_ms"] = {}
    for v in ("old", "new"):
        for n in (16, 256):
            xs = []
            for f in sorted(d.glob(f"{v}-{n}-r*.json")):
                try:
                    xs.append(round(json.loads(f.read_text())["bench"]["best_ms"], 2))
                except (ValueError, KeyError):
                    pass
            res["bench_best_ms"][f"{v}-{n}"] = xs
    # census-env-256: NEW with device_wide_check.sh's CENSUS_ENV
    names = ("new-16", "new-256", "old-256", "env-256")
    res["census"] = {name: census(d / f"census-{name}.json") for name in names}
    res["timed_forward"] = {name: timed(d / f"census-{name}.json") for name in names}
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
        return
    print(f"GPU {res['gpu']}; commit {res['commit']}")
    failed = [l for l in res["rc"] if l and " rc=0 " not in l + " "]
    print("steps not ending rc=0:", "; ".join(failed) if failed else "none")
    print("unit:", "; ".join(res["unit"]) or "no result line", "failed:", res["unit_failed"] or "none")
    for n, m in res["new_vs_old"].items():
        print(f"NEW vs OLD at {n} tokens: {m}")
    for k, xs in res["bench_best_ms"].items():
        mean = f"{sum(xs) / len(xs):.2f}" if xs else "-"
        print(f"best of 5, {k}: {' / '.join(map(str, xs))} (mean {mean})")
    for name, c in res["census"].items():
        print(f"census {name}: {sum(v[0] for v in c.values()):.0f} kernels, {sum(v[1] for v in c.values()):.0f} µs")
    for name, c in res["timed_forward"].items():
        print(f"timed forward {name}: {sum(v[0] for v in c.values())} kernels, "
              f"{sum(v[1] for v in c.values()):.0f} µs")
    old, new = res["timed_forward"]["old-256"], res["timed_forward"]["new-256"]
    rows = sorted(set(old) | set(new), key=lambda k: -max(old.get(k, [0, 0])[1], new.get(k, [0, 0])[1]))
    print("the timed 256-token forward, OLD → NEW (launches, µs):")
    for k in rows[:40]:
        o, w = old.get(k, [0, 0]), new.get(k, [0, 0])
        print(f"  {k[:60]:60s} {o[0]:5.0f} {o[1]:8.1f} → {w[0]:5.0f} {w[1]:8.1f}")


if __name__ == "__main__":
    main()

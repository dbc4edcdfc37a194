#!/usr/bin/env python3
"""Figures of one tools/device_variants.sh result dir (environment variants of one binary).

Usage: tools/device_variants_summary.py RESULT_DIR [--json] [--top N]
Prints: the unit tests' result lines, every variant against the first one's 256-token dump
(modules, largest |diff|, worst rel-L2, verdict), the interleaved --bench rounds (best of 5 each)
per variant and length, the timelines of PROFILE=1 (GPU end, host end, idle bound, host-paced
marks), and the ncu census of each variant's timed 256-token forward: kernels and µs in all and the
N (25) kernels whose time moves most between the first variant and the others.
"""
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_ab_summary import timed  # noqa: E402


def variants(d):
    out = []
    for line in (d / "variants.txt").read_text().splitlines():
        name, _, env = line.partition(": ")
        out.append((name, env.strip()))
    return out


def collect(d):
    """The figures of result dir D (or of its one result subdir) as a dict."""
    subs = [p for p in d.iterdir() if p.is_dir() and (p / "rc.txt").exists()] if d.is_dir() else []
    if not (d / "rc.txt").exists() and len(subs) == 1:
        d = subs[0]
    vs = variants(d)
    first = vs[0][0]
    res = {"gpu": (d / "gpu.txt").read_text().strip(), "commit": (d / "commit.txt").read_text().strip(),
           "variants": dict(vs)}
    res["rc"] = [l for l in (d / "rc.txt").read_text().split("\n") if l]
    # each failed step's first error line (else its first line): why it failed, without opening logs
    res["why_failed"] = {}
    for l in res["rc"]:
        name = l.split(" ", 1)[0]
        log = d / f"{name}.log"
        if " rc=0 " not in l + " " and log.exists():
            lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
            why = next((x for x in lines if re.search(r"panicked|error", x, re.I)), lines[0] if lines else "")
            res["why_failed"][name] = why[:300]
    unit = "".join((d / f).read_text(errors="replace") for f in ("unit.log", "unit.json") if (d / f).exists())
    res["unit"] = re.findall(r"test result: \w+\. \d+ passed; \d+ failed", unit)
    res["unit_failed"] = re.findall(r"^test (\S+) \.\.\. FAILED", unit, re.M)
    res["vs_first_256"] = {}
    for name, _ in vs[1:]:
        f = d / f"vs-{first}-256-{name}.json"
        try:
            fwd = json.loads(f.read_text())
            mods = fwd["modules"]
            res["vs_first_256"][name] = {
                "modules": len(mods),
                "max_abs": max(m.get("max_abs") or 0 for m in mods),
                "worst_rel_l2": max(m.get("rel_l2") or 0 for m in mods),
                "verdict": fwd.get("verdict"),
            }
        except (OSError, ValueError, KeyError) as e:
            res["vs_first_256"][name] = {"error": f"{f.name}: {e}"}
    res["bench_best_ms"] = {}
    for f in sorted(d.glob("bench-*-r*-*.json")):
        m = re.match(r"bench-(\d+)-r(\d+)-(.+)\.json", f.name)
        if not m:
            continue
        try:
            best = round(json.loads(f.read_text())["bench"]["best_ms"], 2)
        except (ValueError, KeyError, TypeError):
            continue
        res["bench_best_ms"].setdefault(f"{m.group(3)}@{m.group(1)}", []).append(best)
    res["timed_forward"] = {name: timed(d / f"census-256-{name}.json") for name, _ in vs}
    res["timeline"] = {}
    for f in sorted(d.glob("profile-*-*.json")):
        m = re.match(r"profile-(\d+)-(.+)\.json", f.name)
        try:
            t = json.loads(f.read_text())["bench"]["timeline"]
        except (ValueError, KeyError, TypeError):
            continue
        if m and t:
            res["timeline"][f"{m.group(2)}@{m.group(1)}"] = timeline_figures(t)
    return res


def timeline_figures(t):
    """forward --profile's timeline as glmcheck's JSON gives it: GPU end, host end, its bound on the
    GPU's idle time (Timeline::idle_bound_ms) and the marks the GPU reached within HOST_PACED_MS of
    their launch (Timeline::host_paced), the five of largest idle bound first."""
    if not t.get("gpu_events") or t.get("idle_bound_ms") is None:
        return {"gpu_events": False, "total_ms": t.get("total_ms")}
    paced = t.get("host_paced", [])
    largest = sorted(((round(p["idle_ms"], 3), p["module"]) for p in paced), reverse=True)[:5]
    return {"gpu_events": True, "total_ms": round(t["total_ms"], 3), "host_ms": round(t["host_ms"], 3),
            "idle_bound_ms": round(t["idle_bound_ms"], 3), "host_paced": len(paced), "largest_idle": largest}


def main():
    res = collect(Path(sys.argv[1]))
    top = int(sys.argv[sys.argv.index("--top") + 1]) if "--top" in sys.argv else 25
    vs = list(res["variants"].items())
    first = vs[0][0]
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
        return
    print(f"GPU {res['gpu']}; commit {res['commit']}")
    for name, env in vs:
        print(f"variant {name}: {env or '(defaults)'}")
    failed = [l for l in res["rc"] if " rc=0 " not in l + " "]
    print("steps not ending rc=0:", "; ".join(failed) if failed else "none")
    for name, why in res["why_failed"].items():
        print(f"  {name}: {why}")
    print("unit:", "; ".join(res["unit"]) or "no result line", "failed:", res["unit_failed"] or "none")
    for n, m in res["vs_first_256"].items():
        print(f"{n} vs {first} at 256 tokens: {m}")
    for k, xs in res["bench_best_ms"].items():
        print(f"best of 5, {k}: {' / '.join(map(str, xs))} (mean {sum(xs) / len(xs):.2f})")
    for k, t in res["timeline"].items():
        print(f"timeline {k}: {t}")
    tf = res["timed_forward"]
    for name, c in tf.items():
        print(f"timed forward {name}: {sum(v[0] for v in c.values())} kernels, "
              f"{sum(v[1] for v in c.values()):.0f} µs")
    keys = set().union(*tf.values()) if tf else set()
    base = tf.get(first, {})

    def moved(k):
        return max(abs(c.get(k, [0, 0])[1] - base.get(k, [0, 0])[1]) for c in tf.values())

    rows = sorted(keys, key=lambda k: (-moved(k), -base.get(k, [0, 0])[1]))
    print("the timed 256-token forward per variant (launches µs), the kernels that move most:")
    print(f"  {'':60s} " + " ".join(f"{n[:18]:>18s}" for n in tf))
    for k in rows[:top]:
        cells = " ".join(f"{c.get(k, [0, 0])[0]:5.0f} {c.get(k, [0, 0])[1]:12.1f}" for c in tf.values())
        print(f"  {k[:60]:60s} {cells}")


if __name__ == "__main__":
    main()

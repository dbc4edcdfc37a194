#!/usr/bin/env python3
"""Pick the variant a follow-up GPU call should run with, from a tools/device_variants.sh result dir.

Usage: tools/device_pick_variant.py [--margin 0.02] RESULT_DIR
Prints one line: the chosen variant's environment (VAR=V pairs, empty for the defaults), for
`env $(tools/device_pick_variant.py /tmp/v) …` on a machine still warm from the variants call; the
reasoning goes to stderr. A variant qualifies when its 256-token forward was within tolerance of the
first variant's dump, every interleaved 256-token round of it ran (and of the first), and the unit
step neither failed nor timed out, and it does not switch the matmul mode (GLMCHECK_VARIANT_MATMUL);
the fastest
(mean of its rounds' best-of-5 at 256 tokens) wins when it beats the first variant by more than the
margin, else the first variant (the defaults) stays.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from device_variants_summary import collect  # noqa: E402


def mean(xs):
    return sum(xs) / len(xs) if xs else None


def main():
    args = sys.argv[1:]
    margin = 0.02
    if "--margin" in args:
        i = args.index("--margin")
        margin = float(args[i + 1])
        del args[i:i + 2]
    res = collect(Path(args[0]))
    names = list(res["variants"])
    first = names[0]
    runs = {n: res["bench_best_ms"].get(f"{n}@256", []) for n in names}
    rounds = max(len(xs) for xs in runs.values())
    times = {n: mean(xs) for n, xs in runs.items()}
    # a unit step that failed, timed out or crashed (rc.txt) blocks every pick, as a FAILED test does
    unit_rc = [l for l in res["rc"] if l.startswith("unit ") and " rc=0 " not in l + " "]
    if res["unit_failed"] or unit_rc or len(runs[first]) < rounds or not rounds:
        print(f"defaults kept: unit failures {res['unit_failed'] or unit_rc}, first variant's rounds "
              f"{runs[first]} of {rounds}", file=sys.stderr)
        print(res["variants"][first])
        return
    ok = [first]
    for n in names[1:]:
        vs = res["vs_first_256"].get(n, {})
        if "GLMCHECK_VARIANT_MATMUL=" in res["variants"][n]:
            # another --matmul mode (tools/device_variants.sh): measured beside, never the pair's dequant
            print(f"{n} not eligible: another matmul mode ({res['variants'][n]})", file=sys.stderr)
            continue
        if vs.get("verdict") == "within tolerance" and len(runs[n]) == rounds:
            ok.append(n)
        else:
            print(f"{n} not eligible: {vs}, rounds {runs[n]}", file=sys.stderr)
    best = min(ok, key=lambda n: times[n])
    if best != first and times[best] > times[first] * (1 - margin):
        best = first
    print(f"chosen {best}: " + ", ".join(f"{n} {times[n]:.2f} ms" for n in ok), file=sys.stderr)
    print(res["variants"][best])


if __name__ == "__main__":
    main()

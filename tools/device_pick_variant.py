#!/usr/bin/env python3
"""Pick the variant a follow-up GPU call should run with, from a tools/device_variants.sh result dir.

Usage: tools/device_pick_variant.py RESULT_DIR [--margin 0.02]
Prints one line: the chosen variant's environment (VAR=V pairs, empty for the defaults), for
`env $(tools/device_pick_variant.py /tmp/v) …` on a machine still warm from the variants call; the
reasoning goes to stderr. A variant qualifies when its 256-token forward was within tolerance of the
first variant's dump, every interleaved round of it ran, and no unit test failed; the fastest
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
    res = collect(Path(sys.argv[1]))
    margin = float(sys.argv[sys.argv.index("--margin") + 1]) if "--margin" in sys.argv else 0.02
    names = list(res["variants"])
    first = names[0]
    rounds = max((len(xs) for xs in res["bench_best_ms"].values()), default=0)
    times = {n: mean(res["bench_best_ms"].get(f"{n}@256", [])) for n in names}
    if res["unit_failed"] or times[first] is None:
        print(f"defaults kept: unit failures {res['unit_failed']}, first variant timed {times[first]}",
              file=sys.stderr)
        print(res["variants"][first])
        return
    ok = [first]
    for n in names[1:]:
        vs = res["vs_first_256"].get(n, {})
        if vs.get("verdict") == "within tolerance" and len(res["bench_best_ms"].get(f"{n}@256", [])) == rounds:
            ok.append(n)
        else:
            print(f"{n} not eligible: {vs}, rounds {res['bench_best_ms'].get(f'{n}@256')}", file=sys.stderr)
    best = min(ok, key=lambda n: times[n])
    if best != first and times[best] > times[first] * (1 - margin):
        best = first
    print(f"chosen {best}: " + ", ".join(f"{n} {times[n]:.2f} ms" for n in ok), file=sys.stderr)
    print(res["variants"][best])


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Whether a CUDA source's kernels compile to the same PTX as at another commit: every kernel
(`.entry`) of the old file against the same kernel of the new one, up to names (the anonymous
namespace's hash, branch-label numbers, and template arguments the new file appends with their
default, e.g. an `int ST = 0` parameter added for an opt-in variant). An opt-in kernel variant
should leave every default instantiation's PTX unchanged: this says so, or names the ones that
changed.

Usage: tools/ptx_unchanged.py REV cuda/dequant_gemm.cu [--default-arg Li0E] [--arch 90]
Needs nvcc (tools/build-cuda.sh's venv: CUDA_HOME, or nvcc on PATH). Exit 0: all the same; 1: some
changed or are missing; 2: a compile failed.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NS = r"_ZZ?N\d+_GLOBAL__N__[0-9a-f]+_\d+_[A-Za-z0-9_]+?_cu_[0-9a-f]{8}"


def nvcc() -> str:
    home = os.environ.get("CUDA_HOME")
    return str(Path(home) / "bin" / "nvcc") if home else "nvcc"


def ptx(src: Path, out: Path, arch: str) -> None:
    inc = ["-I", str(ROOT / "cuda")]
    if os.environ.get("CUDA_HOME"):
        inc += ["-I", str(Path(os.environ["CUDA_HOME"]) / "include")]
    cmd = [nvcc(), "-O3", "-std=c++17", "--expt-relaxed-constexpr", "-ptx", f"-arch=sm_{arch}", "-w", *inc,
           str(src), "-o", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.stderr.write(p.stderr)
        sys.exit(2)


def entries(path: Path) -> dict:
    s = path.read_text()
    out = {}
    for m in re.finditer(r"\.entry (\S+)\(", s):
        end = s.index("\n}\n", m.start())
        out[m.group(1)] = s[m.start():end]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("rev")
    ap.add_argument("source")
    ap.add_argument("--default-arg", action="append", default=[],
                    help="a mangled template argument the new file appends with its default (e.g. Li0E for an added `int = 0`)")
    ap.add_argument("--arch", default=os.environ.get("CUDA_COMPUTE_CAP", "90"))
    a = ap.parse_args()
    old_src = subprocess.run(["git", "-C", str(ROOT), "show", f"{a.rev}:{a.source}"], capture_output=True,
                             text=True)
    if old_src.returncode != 0:
        sys.exit(f"git show {a.rev}:{a.source}: {old_src.stderr.strip()}")
    with tempfile.TemporaryDirectory() as tmp:
        t = Path(tmp)
        (t / "old.cu").write_text(old_src.stdout)
        ptx(t / "old.cu", t / "old.ptx", a.arch)
        ptx(ROOT / a.source, t / "new.ptx", a.arch)
        old, new = entries(t / "old.ptx"), entries(t / "new.ptx")

    def strip(n: str) -> str:
        n = re.sub(NS, "", n)
        for d in a.default_arg:
            n = n.replace(d + "EEv", "EEv")
        return n

    def norm(body: str, name: str) -> str:
        body = body.replace(name, "K")
        body = re.sub(NS, "NS_", body)
        for d in a.default_arg:
            body = body.replace(d + "EEv", "EEv")
        return re.sub(r"\$L__BB\d+_", "LBB_", body)

    by = {strip(n): n for n in new}
    changed = [strip(n) for n in old if strip(n) not in by or norm(old[n], n) != norm(new[by[strip(n)]], by[strip(n)])]
    print(f"{a.source}: {len(old) - len(changed)} of {len(old)} kernels at {a.rev} compile to the same PTX "
          f"(up to names); {len(new) - len(old) + len(changed)} of {len(new)} now are new or changed")
    for c in changed:
        print(f"  changed or missing: {c[:120]}")
    sys.exit(1 if changed else 0)


if __name__ == "__main__":
    main()

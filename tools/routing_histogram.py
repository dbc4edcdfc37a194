#!/usr/bin/env python3
"""Rows per routed expert in a glmcheck (or transformers hook) dump, and what each tile rule of
dequant mode's register kernel decodes (numpy only).

For every `model.layers.N.mlp.gate.topk_indices` capture (`[T, k]` expert ids) of the dump: the
experts that got rows, their row counts, and the weight decodes per active expert of
  tile16 / tile32  one launch at that tile: an expert of r rows decodes its weights ceil(r / w) times;
  runs             the default since a51d245 (Grouping::tile_runs at 256 tokens of GLM-5): the
                   experts of at most 16 rows at 16, the others in a launch of their own at 32.
Usage: tools/routing_histogram.py DUMP.safetensors [--json]
  e.g. glmcheck forward m.gguf --tokens 1000,...,1255 --device cpu --dtype bf16 --max-new-tokens 0 --dump DUMP
"""
import json
import struct
import sys

import numpy as np


def indices(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        base = 8 + n
        for key, v in sorted(header.items()):
            if not key.endswith("mlp.gate.topk_indices"):
                continue
            dt = {"I64": np.int64, "U32": np.uint32, "I32": np.int32}.get(v["dtype"])
            if dt is None:
                continue
            s, e = v["data_offsets"]
            f.seek(base + s)
            yield key, np.frombuffer(f.read(e - s), dtype=dt).reshape(v["shape"])


def stats(ids):
    counts = np.bincount(ids.ravel().astype(np.int64))
    rows = counts[counts > 0]
    per = lambda d: round(float(d) / len(rows), 4)
    light, heavy = rows[rows <= 16], rows[rows > 16]
    return {
        "active": int(len(rows)), "rows": int(rows.sum()), "mean": round(float(rows.mean()), 2),
        "max": int(rows.max()), "over_16": int((rows > 16).sum()), "over_32": int((rows > 32).sum()),
        "decodes_per_active": {
            "tile16": per(np.ceil(rows / 16).sum()), "tile32": per(np.ceil(rows / 32).sum()),
            "runs": per(np.ceil(light / 16).sum() + np.ceil(heavy / 32).sum()),
        },
    }


def main():
    res = {key: stats(ids) for key, ids in indices(sys.argv[1])}
    if "--json" in sys.argv:
        print(json.dumps(res, indent=1))
        return
    for key, s in res.items():
        d = s["decodes_per_active"]
        print(f"{key}: {s['active']} experts, {s['rows']} rows, mean {s['mean']}, max {s['max']}, "
              f">16: {s['over_16']}, >32: {s['over_32']}; decodes per expert: tile 16 {d['tile16']}, "
              f"tile 32 {d['tile32']}, runs {d['runs']}")


if __name__ == "__main__":
    main()

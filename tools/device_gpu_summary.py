#!/usr/bin/env python3
"""Summarize tools/device_gpu_bench.sh results (phase A and/or B result directories, unpacked from the
x.tar.xz each call returns) into reports/gpu.md and reports/gpu.json.

Usage: tools/device_gpu_summary.py RESULTDIR [RESULTDIR ...] [--commit C] [--date D] [--out-dir reports]

Never invents a number: whatever a run did not produce is null in the JSON and "not measured" in the
markdown. Definitions (also written into the report):
  glmcheck_ms      `glmcheck forward --bench 5` "forward_seconds": best of 5 plain forwards, load excluded
  transformers_ms  tools/hf_bench.py: best of 5 forwards after 2 warm-ups (median kept beside it)
  llamacpp_ms      llama-bench -p N -n 0 -r 5: fastest of its 5 samples (samples_ns; avg_ns kept beside it)
  ratio            glmcheck_ms / transformers_ms (> 1: glmcheck slower)
  bound_ms         bytes of the GGUF a forward must read at least / device copy bandwidth (read+write
                   convention, the rate at which the memory moves bytes): every tensor whole, except
                   token_embd (only the prompt's rows) and the routed experts (only the experts the
                   router used in each MoE layer: counted by hf_bench on transformers' forward of the
                   same tokens, else the expectation under uniform routing, said in `bound_basis`)
  peak_gpu_gb      glmcheck's process: most GPU memory in use (nvidia-smi, sampled every 250 ms, CUDA
                   context included); transformers' peak (torch allocator) is `transformers_peak_gpu_gb`
"""

import argparse
import datetime
import json
import os
import re
import statistics

SEQS = (16, 256)

# Issue 12's reference figures for transformers 5.23 (bf16, random weights, this 3-layer setup, median of 5)
# on an H200, 2026-12-02: a same-run transformers far from them says the peer ran unusually (a slow host
# makes its launch-bound forward slower), and the report says so beside the same-run ratio.
ISSUE_TRANSFORMERS_MS = {"H200": {16: 10.0, 256: 19.4}}
PEER_SPEED_TOLERANCE = 1.25  # a peer this many times slower or faster than the reference is flagged


def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def first(dirs, name, loader=load):
    for d in dirs:
        v = loader(os.path.join(d, name))
        if v is not None:
            return v, d
    return None, None


def text(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def spans(d):
    t, out, rcs, lines = {}, {}, {}, []
    raw = text(os.path.join(d, "times.txt")) or ""
    for line in raw.splitlines():
        p = line.split()
        if len(p) == 2 and p[1].endswith(("-start", "-end")):
            t[p[1]] = float(p[0])
        elif len(p) >= 2 and p[1].startswith("rc="):
            rcs[p[0]] = p[1][3:]
        if not re.match(r"^\d+\.\d+ \S+-(start|end)$", line):
            lines.append(line)
    for k, v in t.items():
        if k.endswith("-start") and k[:-6] + "-end" in t:
            out[k[:-6]] = t[k[:-6] + "-end"] - v
    return out, rcs, lines


def mem_peak_gb(path):
    raw = text(path)
    if not raw:
        return None
    vals = [float(x) for x in raw.split() if re.fullmatch(r"\d+(\.\d+)?", x)]
    return max(vals) * 1048576 / 1e9 if vals else None


def uniform_expected(n_exp, k, t):
    return n_exp * (1 - (1 - k / n_exp) ** t)


def needed_bytes(inspect, seq, routing):
    """Lower bound on GGUF bytes one forward of `seq` tokens reads; returns (bytes, basis) or (None, why)."""
    if not inspect or not inspect.get("tensors"):
        return None, "no inspect.json"
    cfg = inspect.get("config", {})
    n_exp, k = cfg.get("n_routed_experts"), cfg.get("num_experts_per_tok")
    total, basis = 0, set()
    for t in inspect["tensors"]:
        name, b = t["name"], t["bytes"]
        m = re.match(r"blk\.(\d+)\.ffn_(gate|up|down)_exps\.weight$", name)
        if name == "token_embd.weight":
            vocab = max(t["shape"]) if t.get("shape") else None
            total += b * min(seq, vocab) / vocab if vocab else b
        elif m:
            layer = int(m.group(1))
            used = (routing or {}).get(layer)
            if used is not None:
                basis.add("measured routing (transformers, same tokens)")
            elif n_exp and k:
                used = uniform_expected(n_exp, k, seq)
                basis.add("uniform-routing expectation")
            else:
                used, _ = n_exp or 1, basis.add("all experts (no config)")
            total += b * min(used, n_exp) / n_exp if n_exp else b
        else:
            total += b
    return total, ", ".join(sorted(basis)) or "dense only"


def routing_of(hf_run):
    out = {}
    for key, n in (hf_run or {}).get("distinct_experts_per_moe_layer", {}).items():
        m = re.match(r"model\.layers\.(\d+)\.mlp\.gate$", key)
        if m:
            out[int(m.group(1))] = n
    return out


def llama_ms(lb):
    out = {}
    for r in lb or []:
        if r.get("n_gen", 0) == 0 and r.get("n_prompt"):
            s = r.get("samples_ns") or []
            out[r["n_prompt"]] = {"best_ms": min(s) / 1e6 if s else None,
                                  "avg_ms": r["avg_ns"] / 1e6 if r.get("avg_ns") is not None else None,
                                  "samples": len(s)}
    return out


def fmt(v, spec=".2f", unit=""):
    return "not measured" if v is None else f"{v:{spec}}{unit}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--commit")
    ap.add_argument("--date")
    ap.add_argument("--note", action="append", default=[], help="a line for the report's notes (repeatable)")
    ap.add_argument("--out-dir", default="reports")
    ap.add_argument("--replace", action="store_true",
                    help="overwrite an OUT_DIR/gpu.json written for another commit or date (refused otherwise)")
    ap.add_argument("--label", action="append", default=[], metavar="SEQ:MODE=TEXT",
                    help="what a run's matmul column says (e.g. '256:q8=q8, GLMCHECK_Q8_DENSE=wide' when that "
                         "run's glmcheck had a route switched by the environment); kept in the JSON as 'route'")
    a = ap.parse_args()
    labels = {}
    for l in a.label:
        key, _, text_ = l.partition("=")
        seq, _, mode = key.partition(":")
        if not (seq.isdigit() and mode and text_):
            ap.error(f"--label {l!r}: SEQ:MODE=TEXT")
        labels[(int(seq), mode)] = text_
    dirs = a.dirs

    envs = {d: text(os.path.join(d, "env.txt")) or "" for d in dirs}
    commit = a.commit
    if not commit:
        for e in envs.values():
            m = re.search(r"^commit=(\S+)", e, re.M)
            if m and m.group(1) != "unknown":
                commit = m.group(1)
                break
    date = a.date
    if not date:
        for e in envs.values():
            m = re.search(r"start=(\d{4}-\d\d-\d\d)", e)
            if m:
                date = m.group(1)
                break
    date = date or datetime.date.today().isoformat()
    gpu = None
    for d in dirs:
        g = text(os.path.join(d, "gpu.csv"))
        if g and "name" in g.splitlines()[0]:
            gpu = g.strip().splitlines()[-1]
    glm_version = None
    for e in envs.values():
        m = re.search(r"^(glmcheck \S+.*)$", e, re.M)
        if m:
            glm_version = m.group(1)

    hf, hf_dir = first(dirs, "hf-bench.out.json")
    if hf is None:
        hf, hf_dir = first(dirs, "hf-bench.json")
    hf_runs = {r["seq"]: r for r in (hf or {}).get("runs", []) if "seq" in r}
    inspect, _ = first(dirs, "inspect.json")
    synth, _ = first(dirs, "synth.json")
    refs = {}
    for mode in ("dequant", "default", "q8"):
        r, _ = first(dirs, f"cuda-bf16-{mode}-16-vs-hf.json")
        if r is not None:
            refs[mode] = r
    lb, _ = first(dirs, "llama-bench.json")
    lbm = llama_ms(lb)
    deq, _ = first(dirs, "dequant-cuda.json")

    copy_rw, copy_src = None, None
    if hf and hf.get("copy"):
        copy_rw, copy_src = hf["copy"]["copy_gbps_rw"], "tools/hf_bench.py torch device-to-device copy, read+write"
    elif deq and deq.get("copy_gbps") is not None:
        copy_rw, copy_src = deq["copy_gbps"], "glmcheck dequant copy_gbps (its own convention)"

    # reference agreement (16 tokens, bf16), per matmul mode
    def agreement(ref, mode):
        mods = [m for m in ref["modules"] if m.get("rel_l2") is not None]
        main_mods = [m for m in mods if not m.get("aux")] or mods
        worst = max(main_mods, key=lambda m: m["rel_l2"]) if main_mods else None
        lg = ref.get("logits") or {}
        return {"verdict": ref.get("verdict"), "modules_compared": len(main_mods),
                "aux_compared": len(mods) - len(main_mods),
                "worst_module": worst["name"] if worst else None,
                "max_module_rel_l2": worst["rel_l2"] if worst else None,
                "kl_mean": lg.get("kl_mean"), "kl_max": lg.get("kl_max"),
                "top1": f'{lg.get("top1_agree_count")}/{lg.get("positions")}' if lg else None,
                "first_divergence": ref.get("first_divergence"),
                "tolerances": (ref.get("comparison") or {}).get("tolerances"),
                "matmul": mode}
    agrees = {m: agreement(r, m) for m, r in refs.items() if r.get("modules") is not None}
    agree = agrees.get("dequant") or agrees.get("default") or agrees.get("q8")

    all_spans, all_rcs, all_lines = {}, {}, {}
    for d in dirs:
        s, r, l = spans(d)
        all_spans[d], all_rcs[d], all_lines[d] = s, r, l

    modes = []
    for d in dirs:
        for f in sorted(os.listdir(d)):
            m = re.match(r"cuda-bf16-((?:dequant|q8|default)(?:_[a-z0-9]+)?)-(\d+)\.json$", f)
            if m and m.group(1) not in modes:
                modes.append(m.group(1))
    modes = modes or ["dequant", "q8"]

    runs = []
    for seq in SEQS:
        hr = hf_runs.get(seq) or {}
        nb, basis = needed_bytes(inspect, seq, routing_of(hr))
        for mode in modes:
            name = f"cuda-bf16-{mode}-{seq}"
            g, gdir = first(dirs, name + ".json")
            gms = g["forward_seconds"] * 1e3 if g and g.get("forward_seconds") is not None else None
            tms = hr.get("min_ms")
            row = {
                "seq": seq, "matmul": mode, "route": labels.get((seq, mode)), "glmcheck_ms": gms, "transformers_ms": tms,
                "llamacpp_ms": (lbm.get(seq) or {}).get("best_ms"),
                "ratio": gms / tms if gms is not None and tms else None,
                "bound_ms": nb / (copy_rw * 1e9) * 1e3 if nb is not None and copy_rw else None,
                "max_module_rel_l2": None, "logits_kl": None,
                "peak_gpu_gb": mem_peak_gb(os.path.join(gdir, name + ".mem")) if gdir else None,
                # beside the schema
                "transformers_median_ms": hr.get("median_ms"),
                "transformers_peak_gpu_gb": hr["peak_gpu_bytes_during_forwards"] / 1e9
                if hr.get("peak_gpu_bytes_during_forwards") is not None else None,
                "llamacpp_avg_ms": (lbm.get(seq) or {}).get("avg_ms"),
                "bound_bytes": nb, "bound_basis": basis if nb is not None else None,
                "glmcheck_verdict": g.get("verdict") if g else None,
            }
            ref = next((v.get(seq) for k, v in ISSUE_TRANSFORMERS_MS.items() if k in (gpu or "")), None)
            row["issue_transformers_ms"] = ref
            tmed = hr.get("median_ms")  # the reference is a median of 5
            row["transformers_vs_issue"] = tmed / ref if tmed and ref else None
            row["ratio_vs_issue_transformers"] = gms / ref if gms is not None and ref else None
            if seq == 16 and mode in agrees:
                row["max_module_rel_l2"] = agrees[mode]["max_module_rel_l2"]
                row["logits_kl"] = agrees[mode]["kl_mean"]
            runs.append(row)

    dequant = []
    if deq and deq.get("types"):
        # glmcheck's own per-type sums: (bytes read + written) / time, and its device copy of the
        # same output in the same run
        for t in deq["types"]:
            dequant.append({"qtype": t["dtype"], "gb_per_s": t["gbps"], "copy_gb_per_s": t["copy_gbps"],
                            "tensors": t["tensors"], "field": "types.gbps",
                            "quantized_bytes_gb_per_s": None})
    elif deq and deq.get("tensors"):
        by = {}
        for t in deq["tensors"]:
            by.setdefault(t.get("dtype"), []).append(t)
        for qt, ts in sorted(by.items()):
            field = "gbps" if any(t.get("gbps") is not None for t in ts) else (
                "out_gbps" if any(t.get("out_gbps") is not None for t in ts) else None)
            vals = [(t[field], t.get("seconds")) for t in ts if field and t.get(field) is not None]
            if vals and all(s for _, s in vals):
                gbs = sum(v * s for v, s in vals) / sum(s for _, s in vals)  # total basis bytes / total time
            elif vals:
                gbs = statistics.median(v for v, _ in vals)
            else:
                gbs = None
            inb = [(t.get("bytes"), t.get("seconds")) for t in ts]
            in_gbs = (sum(b for b, _ in inb) / sum(s for _, s in inb) / 1e9
                      if inb and all(b and s for b, s in inb) else None)
            dequant.append({"qtype": qt, "gb_per_s": gbs, "copy_gb_per_s": deq.get("copy_gbps"),
                            "tensors": len(ts), "field": field, "quantized_bytes_gb_per_s": in_gbs})

    command = ("tools/device_gpu_bench.sh GLMCHECK OUTDIR A (synth --dims glm5 --layers 3 --qtype q4_k_m; "
               "export --hf --dtype bf16; tools/hf_bench.py HF --seq 16,256 --dump; glmcheck forward --device cuda "
               "--dtype bf16 --matmul dequant --reference <dump>) and ... B (glmcheck forward --device cuda --dtype bf16 "
               "--matmul dequant|q8 --max-new-tokens 0 --bench 5 at 16 and 256 tokens; glmcheck dequant --device cuda "
               "--repeat 5; llama-bench -m m.gguf -p 16,256 -n 0 -ngl 99 -r 5 -o json)")
    report = {"gpu": gpu, "date": date, "command": command, "commit": commit, "runs": runs, "dequant": dequant,
              "glmcheck": glm_version,
              "model": {"synth": synth, "file_bytes": (inspect or {}).get("total_bytes"),
                        "hf_parameter_bytes": (hf or {}).get("parameter_bytes")},
              "transformers": {k: (hf or {}).get(k) for k in
                               ("transformers", "torch", "attn_implementation", "experts_implementation",
                                "load_seconds", "loading_info", "gpu_bytes_after_load", "peak_gpu_bytes", "error")},
              "copy": {"gb_per_s_read_plus_write": copy_rw, "source": copy_src,
                       "detail": (hf or {}).get("copy")},
              "reference_agreement": agree, "reference_agreement_by_matmul": agrees,
              "hf_dump": (hf or {}).get("dump"),
              "llamacpp": {"per_seq": lbm, "flash_attn": (lb or [{}])[0].get("flash_attn") if lb else None,
                           "backends": (lb or [{}])[0].get("backends") if lb else None,
                           "gpu_info": (lb or [{}])[0].get("gpu_info") if lb else None},
              "wall_s": all_spans, "notes_from_times": all_lines, "notes": a.note}
    os.makedirs(a.out_dir, exist_ok=True)
    prev = load(os.path.join(a.out_dir, "gpu.json"))
    if prev and (prev.get("commit"), prev.get("date")) != (commit, date) and not a.replace:
        ap.error(f"{a.out_dir}/gpu.json holds the run of commit {prev.get('commit')} on {prev.get('date')}; "
                 "pass --replace to overwrite it, or --out-dir elsewhere")
    with open(os.path.join(a.out_dir, "gpu.json"), "w") as f:
        json.dump(report, f, indent=1)

    L = ["# glmcheck's CUDA forward against transformers and llama.cpp at GLM-5's real dimensions",
         "",
         f"Date {date}, commit `{commit}`, GPU: {gpu or 'not recorded'}; {glm_version or 'glmcheck version not recorded'}. "
         f"Produced by `tools/device_gpu_summary.py` from {len(dirs)} result dir(s) of `tools/device_gpu_bench.sh`.",
         "",
         "Model: `glmcheck synth --dims glm5 --layers 3 --qtype q4_k_m` (random weights, GLM-5's shapes; "
         "1 dense + 2 MoE layers"
         + (f", {synth['bytes'] / 1e9:.2f} GB" if synth and synth.get("bytes") else "") + "). "
         "transformers runs `glmcheck export --hf --dtype bf16` of that file (the GGUF's weights dequantized to "
         "bf16), llama.cpp and glmcheck run the GGUF itself. All bf16, prefill only (no KV cache), tokens "
         "1000..1000+N-1, batch 1.",
         "",
         "| tokens | glmcheck --matmul | glmcheck ms | transformers ms | llama.cpp ms | glmcheck / transformers | bound ms | max module rel-L2 | logits KL | glmcheck peak GPU GB |",
         "|---|---|---|---|---|---|---|---|---|---|"]
    for r in runs:
        L.append(f"| {r['seq']} | {r['route'] or r['matmul']} | {fmt(r['glmcheck_ms'])} | {fmt(r['transformers_ms'])} | "
                 f"{fmt(r['llamacpp_ms'])} | {fmt(r['ratio'])} | {fmt(r['bound_ms'], '.3f')} | "
                 f"{fmt(r['max_module_rel_l2'], '.2e')} | {fmt(r['logits_kl'], '.2e')} | {fmt(r['peak_gpu_gb'], '.1f')} |")
    L += ["",
          "Times: glmcheck = best of 5 (`--bench 5`, load excluded); transformers = best of 5 after 2 warm-ups "
          "(medians: " + ", ".join(f"{s} tokens {fmt((hf_runs.get(s) or {}).get('median_ms'))} ms" for s in SEQS)
          + "); llama.cpp = fastest of `-r 5` samples (averages: "
          + ", ".join(f"{s} tokens {fmt((lbm.get(s) or {}).get('avg_ms'))} ms" for s in SEQS) + ").",
          "",
          "## Peers and environment",
          ""]
    tr = report["transformers"]
    L.append(f"- transformers {tr.get('transformers') or 'not run'} (torch {tr.get('torch')}), "
             f"attn_implementation {tr.get('attn_implementation')}, experts {tr.get('experts_implementation')}; "
             f"load {fmt(tr.get('load_seconds'), '.1f', ' s')}; GPU memory after load "
             f"{fmt(tr['gpu_bytes_after_load'] / 1e9 if tr.get('gpu_bytes_after_load') else None, '.1f', ' GB')}, "
             f"peak {fmt(tr['peak_gpu_bytes'] / 1e9 if tr.get('peak_gpu_bytes') else None, '.1f', ' GB')}"
             + (f"; ERROR: {tr['error']}" if tr.get("error") else "")
             + (f"; loading info (weights NOT from the checkpoint): {tr['loading_info']}" if tr.get("loading_info") else ""))
    for s in SEQS:
        hr = hf_runs.get(s) or {}
        if hr.get("distinct_experts_per_moe_layer"):
            L.append(f"  - {s} tokens: distinct routed experts per MoE layer {hr['distinct_experts_per_moe_layer']}")
        if hr.get("error"):
            L.append(f"  - {s} tokens: ERROR {hr['error']}")
    odd = [r for r in runs if r.get("transformers_vs_issue") and r["matmul"] == runs[0]["matmul"]
           and not 1 / PEER_SPEED_TOLERANCE <= r["transformers_vs_issue"] <= PEER_SPEED_TOLERANCE]
    if odd:
        L.append("- **transformers ran far from the issue's reference times on this GPU** ("
                 + "; ".join(f"{r['seq']} tokens median {fmt(r['transformers_median_ms'])} ms against "
                             f"{r['issue_transformers_ms']} ({r['transformers_vs_issue']:.2f}×)" for r in odd)
                 + "). glmcheck's best of 5 against the reference times: "
                 + "; ".join(f"{r['seq']} tokens {r['route'] or r['matmul']} {fmt(r['ratio_vs_issue_transformers'])}"
                             for r in runs if r.get("ratio_vs_issue_transformers") is not None)
                 + ". The same-run ratio is the acceptance's measure; this says how far it leans on the peer's speed.")
    lc = report["llamacpp"]
    L.append("- llama.cpp (vendored in llama-cpp-python 0.3.36), llama-bench: "
             + (f"backends {lc['backends']}, GPU {lc['gpu_info']}, flash_attn {lc['flash_attn']}" if lb else "not measured"))
    L.append(f"- device copy bandwidth: {fmt(copy_rw, '.0f', ' GB/s')} ({copy_src or 'not measured'}"
             + (f"; {hf['copy']['bytes'] / 2**30:.0f} GiB, one-way {hf['copy']['copy_gbps_oneway']:.0f} GB/s" if hf and hf.get("copy") else "")
             + "). The issue's reference figure: 4.12 TB/s.")
    L += ["", "## glmcheck against transformers, module by module (16 tokens, bf16)", ""]
    for agree in agrees.values():
        L.append(f"- `glmcheck forward --dtype bf16 --matmul {agree['matmul']} --reference <hf_bench dump>`: verdict: {agree['verdict']}; {agree['modules_compared']} modules (+{agree['aux_compared']} auxiliary), "
                 f"worst {agree['worst_module']} rel-L2 {fmt(agree['max_module_rel_l2'], '.2e')}; logits KL mean "
                 f"{fmt(agree['kl_mean'], '.2e')}, max {fmt(agree['kl_max'], '.2e')}; top-1 {agree['top1']}; "
                 f"first divergence: {json.dumps(agree['first_divergence'])}; tolerances: {json.dumps(agree['tolerances'])}")
    # tools/device_q8_check.sh: q8 against the dequant forward of the same file, same GPU
    for dt in ("f32", "bf16"):
        q, _ = first(dirs, f"q8-vs-dequant-{dt}.json")
        if q and q.get("modules") is not None:
            a8 = agreement(q, "q8")
            L.append(f"- `glmcheck forward --dtype {dt} --matmul q8 --reference <glmcheck --matmul dequant dump>` "
                     f"(tools/device_q8_check.sh): verdict: {a8['verdict']}; worst {a8['worst_module']} rel-L2 "
                     f"{fmt(a8['max_module_rel_l2'], '.2e')}; logits KL mean {fmt(a8['kl_mean'], '.2e')}, max "
                     f"{fmt(a8['kl_max'], '.2e')}; top-1 {a8['top1']}; bounds: {json.dumps(a8['tolerances'])}")
    if not agrees:
        L.append("- not measured (no `cuda-bf16-*-16-vs-hf.json`)")
    commits = []
    for d in dirs:
        m = re.search(r"^commit=(\S+)", text(os.path.join(d, "env.txt")) or "", re.M)
        if m:
            commits.append(f"`{os.path.basename(d)}`: {m.group(1)}")
    if commits:
        L += ["", "Commits of the result dirs: " + ", ".join(commits) + "."]
    L += ["", "## GPU dequantization throughput per quant type (`glmcheck dequant --device cuda --repeat 5`)", ""]
    if dequant:
        L += ["| qtype | tensors | GB/s (field) | quantized bytes GB/s | copy GB/s (glmcheck) |", "|---|---|---|---|---|"]
        for q in dequant:
            L.append(f"| {q['qtype']} | {q['tensors']} | {fmt(q['gb_per_s'], '.0f')} ({q['field']}) | "
                     f"{fmt(q['quantized_bytes_gb_per_s'], '.0f')} | {fmt(q['copy_gb_per_s'], '.0f')} |")
    else:
        L.append("not measured (no `dequant-cuda.json`: the binary's dequant may lack --device)")
    L += ["", "## Wall time of each step (load included)", ""]
    for d in dirs:
        L.append(f"- `{os.path.basename(d.rstrip('/'))}`: " + ", ".join(f"{k} {v:.1f} s" for k, v in all_spans[d].items()))
        bad = [l for l in all_lines[d] if re.search(r"rc=[1-9]|skipped|ended \(deadline\)|ERROR", l)]
        if bad:
            L.append("  - " + "; ".join(bad))
    L += ["", "## Commands", "",
          "```",
          "tools/pack_device_peers.sh            # here: target-cuda/bin/{transformers wheel, llama.cpp.tar.xz}",
          "tools/device_gpu_bench.sh /tmp/b/glmcheck /tmp/res-a A   # device call 1, packs $OUT/x.tar.xz",
          "tools/device_gpu_bench.sh /tmp/b/glmcheck /tmp/res-b B   # device call 2",
          "tools/device_gpu_summary.py res-a res-b",
          "```",
          "",
          command,
          "",
          "## What this does and does not show",
          "",
          "- Same weights in all three up to representation: the GGUF's Q4_K_M blocks (glmcheck, llama.cpp) and "
          "their bf16 dequantization (transformers). glmcheck `--matmul dequant` decodes blocks to bf16 for each "
          "GEMM (the routed experts' in shared memory, inside the GEMM: `cuda/dequant_gemm.cu`); `--matmul q8` quantizes activations to 8 bits as llama.cpp's kernels do.",
          "- bound_ms is a lower bound from bytes alone (" + (runs[0]["bound_basis"] or "no basis") + " at 16 tokens): "
          "it ignores compute, launches and the dense weights glmcheck holds dequantized (bf16, larger than "
          "the GGUF's blocks).",
          "- peak GPU memory: glmcheck's is nvidia-smi's used memory sampled every 250 ms (CUDA context "
          "included, short peaks can be missed); transformers' is torch's allocator high-water mark. Not the same "
          "measure.",
          "- One device run per phase: no run-to-run spread. Random weights: routing is not a trained model's.",
          "- Decode (`-n`, KV cache) is not measured; prefill only.",
          ]
    if a.note:
        L += ["", "## Notes on this run", ""] + [f"- {n}" for n in a.note]
    with open(os.path.join(a.out_dir, "gpu.md"), "w") as f:
        f.write("\n".join(L) + "\n")
    print("\n".join(L))


if __name__ == "__main__":
    main()

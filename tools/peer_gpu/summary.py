"""Compact side-by-side of compiled steps: res/CASE.json (shared record.py) + res/CASE.overlap.json (predict.py).
usage: python3 summary.py CASE [CASE ...]   (markdown table on stdout; all figures per device per step)"""
import json, os, sys

P = os.environ.get("P", os.path.join(os.environ.get("TMPDIR", "/tmp"), "jaxtrain-gpupeer"))
G = 2**30
KINDS = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "ragged-all-to-all", "collective-permute")


def col(case):
  r = json.load(open(f"{P}/res/{case}.json"))
  o = json.load(open(f"{P}/res/{case}.overlap.json"))
  m, t = r["memory"], o["totals"]
  out = {"side": r["side"], "mesh": json.dumps(r.get("mesh")),
         "arguments GiB": f"{m['argument_size_in_bytes']/G:.2f}", "temporaries GiB": f"{m['temp_size_in_bytes']/G:.2f}",
         "compiled total GiB": f"{m['total_bytes']/G:.2f}"}
  for k in KINDS:
    c = r["collectives"].get(k)
    out[f"{k} GiB (execs/step)"] = f"{c['bytes_per_step']/G:.2f} ({c['per_step']})" if c else "0"
  out["matmul TFLOP (HLO dots + cuDNN)"] = f"{r['matmul_flops']['total']/1e12:.1f}"
  out["collectives on the link ms"] = f"{t['collective_seconds']*1e3:.1f}"
  for k in KINDS:
    v = o["per_kind"].get(k)
    if v and v["exposed_seconds"] > 5e-5:
      out[f"exposed ms: {k}"] = f"{v['exposed_seconds']*1e3:.1f}"
  out["exposed ms (total)"] = f"{t['exposed_seconds']*1e3:.1f}"
  out["kernels at roofline s"] = f"{t['compute_seconds']:.3f}"
  out["predicted step s"] = f"{t['predicted_step_seconds']:.3f}"
  out["layer loops: AGs async / prefetched / hidden"] = "; ".join(
      f"{l['trip']}x: {l['async']}/{l['all_gathers']} / {l['next_iteration_prefetched']} / {l.get('hidden_fraction', 0):.0%}" for l in o["loops"])
  return out


def main():
  cases = sys.argv[1:]
  cols = [col(c) for c in cases]
  keys = list(dict.fromkeys(k for c in cols for k in c))
  print("| per device per step | " + " | ".join(cases) + " |")
  print("|---" * (len(cases) + 1) + "|")
  for k in keys:
    print(f"| {k} | " + " | ".join(c.get(k, "-") for c in cols) + " |")


if __name__ == "__main__":
  main()

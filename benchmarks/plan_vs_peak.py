"""Issue 42 item 4 from a `cpkv run --json` output file: per rank the memory plan beside the measured peaks (the
run's `plan_vs_peak`), and the run's verification, reference, load and verify seconds, one line each."""
import json
import sys

text = open(sys.argv[1]).read()
rep = json.loads(text[text.index("{"):text.rindex("}") + 1])
for rank, pv in enumerate(rep.get("plan_vs_peak") or []):
    print(f"rank {rank}: plan {pv['plan_total_bytes'] / 1e9:.2f} GB, peak allocated {pv['peak_allocated_bytes'] / 1e9:.2f}"
          f" GB ({pv['allocated_ratio']}), reserved {pv['peak_reserved_bytes'] / 1e9:.2f} GB ({pv['reserved_ratio']}); "
          f"bounds {pv['bounds']}, within 10 % {pv['within_10pct']}")
print("verify ok", rep["verify"] and rep["verify"]["ok"], "reference", rep.get("reference"),
      "load_s", rep["summary"].get("load_s_per_rank"), "verify_s", rep["summary"].get("verify_s"))

#!/bin/bash
# Regenerates planner_at_scale_2026-12-05.txt (the tables) and planner_at_scale_json_2026-12-05.txt (the --json runs,
# one line per candidate) for docs/planner.md. CPU only: the cost model with the given h100 figures, no GPU.
# Run from the repository root with the venv active: bash benchmarks/results/planner_at_scale_2026-12-05.sh
set -u
R=benchmarks/results
TXT=$R/planner_at_scale_2026-12-05.txt
RAW=$(mktemp)
COMMIT=$(git rev-parse --short HEAD)
header() { echo "# $1"; echo "# commit $COMMIT, $(date -u +%Y-%m-%d), by bash $R/planner_at_scale_2026-12-05.sh"; echo; }
external() {
cat <<'TXT'
# External figures, quoted by docs/planner.md (published by others; not computed by this script):
# - torchtitan's H100 hosts: 96 GB HBM2e per GPU, default 500 W power limit. Source: pytorch/torchtitan
#   benchmarks/llama3_h100_202412_torchtitan.md @ 31a17bfdb70bab6f62a13d21816a5339b911d6e3, "Hardware" (the file of
#   T1, T4 and T5 in docs/planner.md).
# - Meta's Llama 3 405B run: H100 GPUs with 80 GB HBM3, 700 W TDP. Source: Llama Team, AI @ Meta, "The Llama 3 Herd
#   of Models", arXiv:2407.21783, section 3.3.1 (the paper of L4 in docs/planner.md); read from a stored summary of
#   the paper, not from arxiv.org.

TXT
}
run() { f=$1; shift; echo "\$ sgdtp plan $*" >> "$f"; sgdtp plan "$@" >> "$f" 2>&1; echo "(exit $?)" >> "$f"; echo >> "$f"; }
{ header "sgdtp plan outputs for docs/planner.md (given h100 figures, not measured on a GPU)"; external; } > $TXT
run $TXT llama3-70b --nodes 4 --gpus-per-node 8 --hardware h100 --rows 1
run $TXT llama3-70b --nodes 4 --gpus-per-node 8 --hardware h100 --rows 1 --materialized
run $TXT llama3-8b --global-batch 16
run $RAW llama3-8b --global-batch 16 --json
run $TXT llama3-8b --global-batch 16 --fix dp=8 --fix sharding=full
run $RAW llama3-8b --global-batch 16 --fix dp=8 --fix sharding=full --json
run $TXT llama3-8b --global-batch 16 --fix dp=8 --fix sharding=full --gpu-memory 96GB
run $TXT llama3-70b --nodes 8 --global-batch 128
run $RAW llama3-70b --nodes 8 --global-batch 128 --json
run $TXT llama3-70b --nodes 8 --global-batch 128 --fix tp=4 --fix pp=8 --fix sharding=none
run $RAW llama3-70b --nodes 8 --global-batch 128 --fix tp=4 --fix pp=8 --fix sharding=none --json
run $TXT llama3-70b --nodes 8 --global-batch 128 --fix tp=4 --fix pp=8 --fix sharding=none --fix pipeline=interleaved_1f1b
run $RAW llama3-70b --nodes 8 --global-batch 128 --fix tp=4 --fix pp=8 --fix sharding=none --fix pipeline=interleaved_1f1b --json
run $TXT llama3-70b --nodes 8 --global-batch 128 --fix tp=4 --fix pp=8 --fix sharding=optimizer
run $TXT llama3-70b --nodes 8 --global-batch 128 --fix dp=64 --fix sharding=full
run $TXT llama3-70b --nodes 32 --global-batch 512
run $RAW llama3-70b --nodes 32 --global-batch 512 --json
run $TXT llama3-70b --nodes 32 --global-batch 512 --fix tp=8 --fix pp=1 --fix sharding=full
run $RAW llama3-70b --nodes 32 --global-batch 512 --fix tp=8 --fix pp=1 --fix sharding=full --json
run $TXT llama3-405b --nodes 64 --global-batch 256 --rows 10000
run $RAW llama3-405b --nodes 64 --global-batch 256 --json
run $TXT llama3-405b --nodes 64 --global-batch 256 --fix tp=8 --fix pp=8 --fix sharding=full
run $RAW llama3-405b --nodes 64 --global-batch 256 --fix tp=8 --fix pp=8 --fix sharding=full --json
run $TXT llama3-405b --nodes 64 --global-batch 128 --rows 10000
run $TXT llama3-405b --nodes 64 --global-batch 128 --fix tp=8 --fix pp=16 --fix sharding=full
run $TXT llama3-405b --nodes 1024 --global-batch 2048 --rows 10000
run $TXT llama3-405b --nodes 1024 --global-batch 2048 --fix tp=8 --fix pp=16 --fix sharding=full
run $TXT llama3-405b --nodes 64
# The --json runs are several MB; kept as one line per candidate: GiB with 2 decimals and ms with 1, as the page.
{ header "sgdtp plan --json outputs for docs/planner.md, one line per candidate (GiB = 2**30 bytes; step parts in ms)"
  python - "$RAW" <<'PY'
import json, sys

GIB = 2**30
text = open(sys.argv[1]).read()
for block in text.split("$ sgdtp plan ")[1:]:
    command, _, rest = block.partition("\n")
    body = rest[: rest.rindex("}") + 1]
    plan = json.loads(body)
    print(f"$ sgdtp plan {command}")
    print(f"limit {plan['limit']} bytes = {plan['limit'] / GIB:.2f} GiB; hardware {plan['hardware']}; "
          f"global batch {plan.get('global_batch')}; candidates {len(plan['candidates'])}")
    chosen = plan.get("chosen")
    print(f"chosen: {chosen['layout'] if chosen else None}: {plan.get('why')}")
    print("layout | built | fits | total GiB | activations GiB | parameters GiB | setup GiB | step ms: compute, bubble, "
          "pipeline_sends, tensor_parallel, data_parallel, optimizer, total | ms/sample")
    for c in plan["candidates"]:
        if "memory" not in c:
            print(f"{c['layout']} | skipped: {c['skipped']}")
            continue
        m, s = c["memory"], c["step_s"]
        built = "built" if c["built"] is True else f"not built ({c['built']})" if c["built"] else "not built"
        parts = ", ".join(f"{s[k] * 1e3:.1f}" for k in
                          ("compute", "bubble", "pipeline_sends", "tensor_parallel", "data_parallel", "optimizer", "total"))
        print(f"{c['layout']} | {built} | {'fits' if c['fits'] else 'too large'} | {m['total'] / GIB:.2f} | "
              f"{m['activations'] / GIB:.2f} | {m['parameters'] / GIB:.2f} | {m['setup'] / GIB:.2f} | {parts} | "
              f"{c['seconds_per_sample'] * 1e3:.1f}")
    print()
PY
} > $R/planner_at_scale_json_2026-12-05.txt
rm -f "$RAW"

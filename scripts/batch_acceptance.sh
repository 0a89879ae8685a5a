#!/usr/bin/env bash
# Batch acceptance: build the job, refuse the duplicate variant, two SIGKILLs, re-run, retry, report, Ray.
# Usage: scripts/batch_acceptance.sh MODEL_DIR OUT_DIR [NUM_LINES] [KILL_AFTER_S] [MAX_NUM_SEQS]
# The job's prompts: the sets shipped in celeris/data, or DATA=folder (tinystories/, mt_bench/, gsm8k/).
set -u
M=$1; D=$2; N=${3:-1000}; K=${4:-60}; S=${5:-8}
PY="${PYTHON:-python}"; CLI="$PY -m celeris.cli"
cd "$(dirname "$0")/.."
mkdir -p "$D"
$PY -m celeris.batch.examples ${DATA:+--data "$DATA"} --out "$D/job.jsonl" --num "$N"
$CLI batch run "$D/job-dup.jsonl" "$D/dup-out.jsonl" --model "$M"; echo "duplicate variant: exit $? (want 2)"
for i in 1 2; do
  $CLI batch run "$D/job.jsonl" "$D/out.jsonl" --model "$M" --max-num-seqs "$S" --no-progress > /dev/null 2>&1 &
  PID=$!; sleep "$K"; kill -9 "$PID"; wait "$PID" 2>/dev/null
  echo "SIGKILL $i: $(grep -c '' "$D/out.jsonl") lines, last byte: $(tail -c 1 "$D/out.jsonl" | od -An -c)"
done
t0=$(date +%s.%N)
$CLI batch run "$D/job.jsonl" "$D/out.jsonl" --model "$M" --max-num-seqs "$S"
echo "re-run after the kills: $(echo "$(date +%s.%N) - $t0" | bc) s"
$CLI batch run "$D/job.jsonl" "$D/out.jsonl" --model "$M" --max-num-seqs "$S" --retry-failed
$CLI batch report "$D/out.jsonl" --input "$D/job.jsonl" --json "$D/report.json" --plot "$D/lengths.png"
t0=$(date +%s.%N)
$CLI batch run "$D/job.jsonl" "$D/out-local-clean.jsonl" --model "$M" --max-num-seqs "$S" --no-progress
echo "local backend, whole job from scratch: $(echo "$(date +%s.%N) - $t0" | bc) s for $N lines"
t0=$(date +%s.%N)
$CLI batch run "$D/job.jsonl" "$D/out-ray.jsonl" --model "$M" --max-num-seqs "$S" --backend ray --num-workers 2 --no-progress
echo "ray backend (2 workers), whole job from scratch: $(echo "$(date +%s.%N) - $t0" | bc) s for $N lines"
$PY - "$D/out.jsonl" "$D/out-ray.jsonl" <<'PYEOF'
import json, sys
def load(path):
    out = {}
    for line in open(path):
        r = json.loads(line)
        key = r["custom_id"] or f"line{r['line']}"
        assert key not in out, f"{path}: {key} twice"
        resp = r["response"]
        out[key] = r["error"]["code"] if resp is None else (resp["status_code"], json.dumps(
            [c.get("text", (c.get("message") or {}).get("content")) for c in resp["body"].get("choices", [])]))
    return out
a, b = load(sys.argv[1]), load(sys.argv[2])
diff = [k for k in a if a[k] != b.get(k)]
print(f"local {len(a)} records, ray {len(b)} records, {len(diff)} differ: {diff[:10]}")
PYEOF

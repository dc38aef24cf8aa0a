# Sourced by the issue-36 device scripts (after their `cd` into benchmarks/, with OUT set and $OUT/results made).
# go LIMIT NAME CMD...: one run under a time limit; its output through go_filter; its record
# (and targets.json) copied to OUT at once.
# go_filter: the output filter; a sourcing script may redefine it after sourcing. Default: drop warnings, keep
# the last 3 lines.
go_filter() { grep -v -i "warn" | tail -3; }
go() {  # one run under a time limit; its record (and targets.json) copied to OUT at once
  local limit=$1 name=$2; shift 2; echo "== $name $(date +%T)"
  timeout "$limit" "$@" 2>&1 | go_filter
  cp "results/$name.json" results/targets.json "$OUT/results/" 2>/dev/null
}

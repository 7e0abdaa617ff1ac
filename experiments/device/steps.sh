# Sourced by experiments/device/check.sh and vllm.sh: the step runner both scripts share.
# The sourcing script sets $log (the log file), $status_file (one "NAME EXIT" line per step), $kill_after (seconds
# between SIGTERM and SIGKILL once a step's limit is up) and defines say().

step() {  # step NAME LIMIT COMMAND...: run with a time limit, log everything, never stop the script
  local name=$1 limit=$2; shift 2
  say "$name: start (limit ${limit}s)"
  timeout --kill-after="$kill_after" "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  say "$name: exit $rc"
  echo "$name $rc" >> "$status_file"
}

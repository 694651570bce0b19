#!/bin/bash
# poll.sh SECONDS [TEXT]: on the device, waits until TEXT (or "== done") is in the pipeline's log or SECONDS have
# passed, then prints the log and the running step's last lines and copies /tmp/res.tar.gz to $OUT (the files a
# call brings back). Read the step's JSONs from the tarball, not its printout.
log=/tmp/res/pipeline.log; end=$(( $(date +%s) + ${1:-10} ))
while [ "$(date +%s)" -lt $end ]; do
  if [ -n "${2:-}" ] && grep -qF -- "$2" $log 2>/dev/null; then break; fi
  grep -q "^== done" $log 2>/dev/null && break
  sleep 3
done
cat $log 2>/dev/null
step=$(grep "^== " $log 2>/dev/null | tail -1 | awk '{print $2}')
[ -n "$step" ] && [ -f "/tmp/res/$step.txt" ] && { echo "--- $step"; tail -c 1500 "/tmp/res/$step.txt"; }
[ -f /tmp/res.tar.gz ] && cp /tmp/res.tar.gz "$OUT/"
nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader

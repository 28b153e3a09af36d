#!/usr/bin/env bash
# Run a command up to three times. Package downloads on a fresh machine sometimes break off
# mid-file (pip does not retry a body that stops short), and one such drop must not fail setup.
set -u
for try in 1 2 3; do
  "$@" && exit 0
  status=$?
  if [ "$try" -lt 3 ]; then
    echo "retry.sh: '$*' exited $status (try $try of 3); again in 10 s" >&2
    sleep 10
  fi
done
exit "$status"

#!/usr/bin/env bash
# Restarts brokers again and again while every core is busy, and fails on the
# first restart that does not exit 0: the proof that `brokers.sh restart` (which
# the fault tests and the chaos run call) watches the process it started and
# waits until the broker answers, loaded or not.
#
#   integration/restart-loop.sh [-n 20] [service...]   (default: kafka sqs rabbitmq)
#
# The brokers must be up (make brokers). Nothing else should use them meanwhile:
# each restart takes the broker away for seconds. make restart-loop runs it.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
N=20
if [[ ${1:-} == -n ]]; then
	N=$2
	shift 2
fi
(($#)) || set -- kafka sqs rabbitmq
[[ $N =~ ^[0-9]+$ ]] && ((N > 0)) || {
	echo "restart-loop: -n wants a positive count, not ${N}" >&2
	exit 2
}

log() { printf 'restart-loop: %s\n' "$*" >&2; }

# One busy loop per core, so that the restarts compete for every core.
hogs=()
stop_hogs() {
	((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null
	wait 2>/dev/null || true
}
trap stop_hogs EXIT
for ((c = 0; c < $(nproc); c++)); do
	(while :; do :; done) &
	hogs+=($!)
done
log "${#hogs[@]} CPU hogs running; restarting $* ${N} times each"

start=$SECONDS
for ((i = 1; i <= N; i++)); do
	for svc in "$@"; do
		t=$SECONDS
		if ! out=$("$ROOT/integration/brokers.sh" restart "$svc" 2>&1); then
			printf '%s\n' "$out" >&2
			log "FAIL: restart $i of $svc exited non-zero after $((SECONDS - t)) s"
			exit 1
		fi
		log "round $i/$N: $svc ready in $((SECONDS - t)) s"
	done
done
log "ok: $((N * $#)) restarts, every one ready, in $((SECONDS - start)) s"

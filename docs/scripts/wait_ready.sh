# Sourced by the side-by-side scripts: wait_ready URL PID waits until URL/health answers 200 (0), or the server
# process PID is gone or 15 minutes have passed (1).
wait_ready() {
    for _ in $(seq 900); do
        curl -sf "$1/health" >/dev/null && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}

# Stage bookkeeping for scripts/test.sh (sourced, not run): every stage runs even when
# one before it failed, failures are listed at the end, and what was started in the
# background is stopped on exit, however the script exits.
START=$SECONDS
FAILED=()
BACKGROUND=()

stage() { # stage NAME CMD...: run CMD, print how long it took, remember a failure
    local name=$1 t0=$SECONDS rc=0
    shift
    echo "== $name"
    "$@" || rc=$?
    if [ "$rc" -ne 0 ]; then
        FAILED+=("$name (exit $rc)")
        echo "== $name: FAILED with exit $rc after $((SECONDS - t0)) s (total $((SECONDS - START)) s)"
    else
        echo "== $name: $((SECONDS - t0)) s (total $((SECONDS - START)) s)"
    fi
    return 0
}

kill_tree() { # kill_tree PID: PID and every process below it, children first
    local child
    for child in $(pgrep -P "$1" 2>/dev/null); do
        kill_tree "$child"
    done
    kill "$1" 2>/dev/null || true
}

background() { # background LOG CMD...: run CMD in the background, output to LOG
    local log=$1
    shift
    "$@" >"$log" 2>&1 &
    BACKGROUND+=("$!")
    LAST_BACKGROUND=$!
}

logged_result() { # logged_result LOG: print what a background check wrote, exit as it did
    cat "$1"
    [ -s "$1.rc" ] || { echo "no exit status recorded in $1.rc" >&2; return 1; }
    return "$(cat "$1.rc")"
}

wait_background() { # wait_background NAME PID LOG: a failed job is a failed stage
    local name=$1 pid=$2 log=$3
    echo "== $name (started in the background)"
    if wait "$pid"; then
        grep '^== ' "$log" || tail -n 3 "$log"
        echo "== $name: done (total $((SECONDS - START)) s)"
        return 0
    fi
    cat "$log"
    FAILED+=("$name")
    echo "== $name: FAILED (total $((SECONDS - START)) s); the stages that need it are skipped"
    return 1
}

finish() { # finish: the list of failed stages and the exit status
    if [ "${#FAILED[@]}" -ne 0 ]; then
        echo "== FAILED after $((SECONDS - START)) s: ${#FAILED[@]} stage(s):"
        printf '   %s\n' "${FAILED[@]}"
        exit 1
    fi
    echo "== all checks passed in $((SECONDS - START)) s"
}

_stop_background() {
    local pid
    for pid in "${BACKGROUND[@]}"; do
        kill_tree "$pid"
    done
}
trap _stop_background EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

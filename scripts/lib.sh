# Shared by the install scripts (sourced, not run).

# Build bsr-io's extension into the active virtualenv. It lands in python/bsr_io/
# (shared by every venv) and the cargo target dir is shared too: a concurrent build can
# race the staging rename, so retry.
develop_bsr_io() {
    local attempt
    for attempt in 1 2 3; do
        if maturin develop --release -q; then return 0; fi
        [ "$attempt" = 3 ] && return 1
        sleep 10
    done
}

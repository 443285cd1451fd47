# Shared by the install scripts (sourced, not run).

# Build bsr-io's extension into the active virtualenv. It lands in python/bsr_io/
# (shared by every venv) and the cargo target dir is shared too: a concurrent build can
# race the staging rename, so retry. Under scripts/test.sh (BSR_IO_SHARED_BUILD set), the
# extension is already built from these sources by scripts/install.sh, and the main tests
# run while this venv installs: rebuilding it would delete and rewrite
# python/bsr_io/_core.abi3.so under a test that is importing it (seen in CI: a demo rank
# failed with "No module named 'bsr_io._core'"). So that build is used as it is.
develop_bsr_io() {
    if [ -n "${BSR_IO_SHARED_BUILD:-}" ] && [ -f python/bsr_io/_core.abi3.so ]; then
        use_shared_build
        return
    fi
    local attempt
    for attempt in 1 2 3; do
        if maturin develop --release -q; then return 0; fi
        [ "$attempt" = 3 ] && return 1
        sleep 10
    done
}

# What `maturin develop` leaves in a venv, without building: the wheel's metadata and
# `bsr-io` console script, and the package imported from python/ (a .pth), not a copy.
use_shared_build() {
    local wheel site
    wheel=$(ls target/wheels/bsr_io-*-abi3-*.whl 2>/dev/null | head -n 1)
    [ -n "$wheel" ] || { echo "no bsr-io wheel in target/wheels: run scripts/install.sh" >&2; return 1; }
    python -m pip install -q --no-deps --force-reinstall "$wheel" || return 1
    site=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    rm -rf "$site/bsr_io"
    printf '%s\n' "$PWD/python" > "$site/bsr_io.pth"
}

#!/usr/bin/env bash
# Runs roving's version-sensitive tests on every other CPython 3.10-3.13 found on this machine.
#
# The main interpreter (the `python3` that scripts/test.sh installs roving into and runs the whole suite
# with) is not run again here. For each other CPython 3.X (X = 10..13) found -- pyenv's newest
# $PYENV_ROOT/versions/3.X.*, else the system's python3.X -- a venv with roving (editable, this checkout)
# and its `dev` extras is kept in $TEST_PYTHONS_CACHE/3.X (default /var/cache/roving-pythons/3.X).
# It is made afresh when pyproject.toml or the interpreter changes, and reused otherwise, so a second
# run installs nothing. PyTorch is not installed there: its CPU build (torch==2.13.0+cpu) is a wheel for
# the main interpreter's 3.11 only here (the configured index has only the multi-GB CUDA build for the
# others), and the tests that need it (test_serialize_torch.py, test_examples.py) are not
# version-sensitive: they run on the main interpreter only, as do the pipeline, backends and hosts suites.
#
# Which tests. All of tests/api, tests/pool and tests/transport (less the torch tests) are 514 tests;
# on this 2-core machine, shared (load average 13-27), CPython 3.12.1 took 15.1 min for the first 438 of
# them. Three more of those would take the test command (16-21 minutes for the whole suite on 3.11) far
# past its 30-minute budget. So each other Python runs the files that test the parts of roving that mirror,
# or lean on, what changes between CPython versions, on the standard library and the embedded local
# backend (their Slurm parameters, the same roving code over a job scheduler, run on the main interpreter;
# the figures and the command are in benchmarks/RESULTS.md, section "Pythons"):
#   - concurrent.futures: test_futures (the Executor side by side with ProcessPoolExecutor, on each
#     Python's own ProcessPoolExecutor);
#   - multiprocessing's managers, Process and Connection: test_managers, test_process, test_process_parity
#     (CPython's own multiprocessing tests' checks), test_connection, test_compat (one program, same output
#     with multiprocessing and with roving), test_main_namespace;
#   - pickling: test_pickling_errors (the exception types pickle raises), tests/transport/test_serialize
#     (pickle protocol 5 out-of-band buffers, cloudpickle, io.BytesIO: 3.12.0-3.12.1's GC crash);
#   - multiprocessing.pool: tests/pool/test_pool, test_pool_parity;
#   - the transport's threads and sockets: tests/transport/test_transport, test_channel.
# Left to the main interpreter: the queues, locks, shared memory and lifetimes (roving's own protocol over
# its transport, the same on every Python), the dashboard (a browser), the transport's fault-injection,
# fuzzing, security and addressing tests, the elastic and upkeep pool tests and the examples: they test
# roving's own protocol and timing, not CPython's, and are where most of the time goes.
# (Not ROVING_*: those are roving's options, and an unknown one is an error.)
# TEST_PYTHONS=3.10,3.13 runs only those of the versions found. TEST_PYTHONS_ALL=1 runs the whole of
# tests/api, tests/pool and tests/transport (no torch tests) instead; pytest arguments given to this
# script (test files, -k ...) run those instead.
#
# Output: which interpreters were found and which run, then one line per version (tests passed, failed,
# minutes since the runs, which go at once, began); exit status 1 if any version failed (its pytest
# output is in $TEST_PYTHONS_CACHE/3.X.log).
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
ROOT=$PWD
CACHE=${TEST_PYTHONS_CACHE:-/var/cache/roving-pythons}
PYENV_DIR=${PYENV_ROOT:-$HOME/.pyenv}

SELECTION=(
    tests/api/test_futures.py tests/api/test_managers.py
    tests/api/test_process.py tests/api/test_process_parity.py tests/api/test_connection.py
    tests/api/test_pickling_errors.py tests/api/test_compat.py tests/api/test_main_namespace.py
    tests/pool/test_pool.py tests/pool/test_pool_parity.py
    tests/transport/test_serialize.py tests/transport/test_transport.py tests/transport/test_channel.py
    -k "not slurm"  # the local backend: what a job scheduler adds is not CPython's
)
if [ "${TEST_PYTHONS_ALL:-0}" = 1 ]; then
    SELECTION=(tests/api tests/pool tests/transport
               --ignore=tests/api/test_examples.py --ignore=tests/transport/test_serialize_torch.py)
fi
if [ $# -gt 0 ]; then
    SELECTION=("$@")  # pytest arguments instead of the selection: `bash scripts/test-pythons.sh tests/api/test_compat.py`
fi

main=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')

# the interpreter for 3.X: pyenv's newest 3.X.*, else python3.X on PATH; it must report 3.X itself
# (a pyenv shim for a version not installed fails, and is passed over)
find_python() {
    local minor=$1 cand
    for cand in $(ls -d "$PYENV_DIR"/versions/3."$minor".* 2>/dev/null | grep -E '/3\.[0-9]+\.[0-9]+$' | sort -V -r \
                  | sed 's|$|/bin/python3|' || true) \
                "$(command -v python3."$minor" || true)"; do
        [ -n "$cand" ] && [ -x "$cand" ] || continue
        if [ "$("$cand" -c 'import sys; print("%d.%d" % sys.version_info[:2])' 2>/dev/null)" = "3.$minor" ]; then
            echo "$cand"
            return 0
        fi
    done
    return 0
}

found=() runs=()
for minor in 10 11 12 13; do
    py=$(find_python "$minor")
    [ -n "$py" ] || continue
    found+=("3.$minor ($py)")
    [ "3.$minor" != "$main" ] || continue
    case ",${TEST_PYTHONS:-3.$minor}," in *",3.$minor,"*) runs+=("3.$minor=$py") ;; esac
done
echo "test-pythons: found ${found[*]:-no CPython 3.10-3.13}"
echo "test-pythons: main interpreter $main (run by scripts/test.sh itself); running here: ${runs[*]:-none}"
[ ${#runs[@]} -gt 0 ] || exit 0

mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock -w 3600 9  # two runs at once would remake one venv under each other

# a venv for 3.X with roving's dev extras, reused while pyproject.toml and the interpreter are unchanged
venv_for() {
    local version=$1 py=$2 venv=$CACHE/$1 install_log=$CACHE/$1.install.log stamp
    stamp="$(sha256sum pyproject.toml | cut -d' ' -f1) $("$py" -c 'import sys; print(sys.version.split()[0], sys.executable)')"
    if [ ! -x "$venv/bin/python" ] || [ "$(cat "$venv/.roving-stamp" 2>/dev/null)" != "$stamp" ]; then
        echo "test-pythons: $version: making $venv (pyproject.toml or the interpreter changed, or none yet)"
        rm -rf "$venv"
        "$py" -m venv "$venv"
        if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[dev]" >"$install_log" 2>&1; then
            grep -v "is ignored: it is neither a file nor a directory" "$install_log" | tail -n 30 >&2 || true
            echo "test-pythons: $version: installing roving[dev] failed (all of it in $install_log)" >&2
            return 1
        fi
        echo "$stamp" >"$venv/.roving-stamp"
    elif [ "$(cat "$venv/.roving-root" 2>/dev/null)" != "$ROOT" ]; then
        # made from another checkout: point the editable install here (its dependencies are in place)
        if ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --no-deps -e "$ROOT" >"$install_log" 2>&1; then
            tail -n 30 "$install_log" >&2
            echo "test-pythons: $version: installing roving failed (all of it in $install_log)" >&2
            return 1
        fi
    fi
    echo "$ROOT" >"$venv/.roving-root"
}

# The venvs first, one after the other (pip); then the versions' test runs all at once: each is about
# half idle here (children starting, waits on the transport), and run one after the other they took
# 10.4 minutes of the test command's 55 (2026-12-03). Each run has its own basetemp.
summaries=() failed=0 ready=()
for run in "${runs[@]}"; do
    version=${run%%=*} py=${run#*=}
    if ! venv_for "$version" "$py"; then
        failed=1
        summaries+=("test-pythons: $version: FAILED: its venv could not be made; see $CACHE/$version.install.log")
        continue
    fi
    ready+=("$version")
done
declare -A pids
start=$SECONDS
for version in "${ready[@]}"; do
    log=$CACHE/$version.log
    echo "test-pythons: $version: python -m pytest ${SELECTION[*]} (output in $log)"
    # this checkout's sources first, whatever PYTHONPATH the caller had
    PYTHONPATH="$ROOT/src" "$CACHE/$version/bin/python" -m pytest -q -p no:cacheprovider \
        --basetemp="$CACHE/$version.tmp" "${SELECTION[@]}" >"$log" 2>&1 &
    pids[$version]=$!
done
for version in "${ready[@]}"; do
    log=$CACHE/$version.log
    rc=0
    wait "${pids[$version]}" || rc=$?
    minutes=$(awk -v s=$((SECONDS - start)) 'BEGIN { printf "%.1f", s / 60 }')
    counts=$(grep -E '(passed|failed|errors?|skipped|deselected|no tests ran).* in [0-9.]+s' "$log" | tail -n 1 \
             | sed -E 's/^=+ //; s/ in [0-9.]+s.*$//' || true)
    full=$("$CACHE/$version/bin/python" -c 'import sys; print(sys.version.split()[0])')
    if [ "$rc" = 0 ]; then
        summaries+=("test-pythons: $full: $counts, done $minutes min after the runs began")
    else
        failed=1
        summaries+=("test-pythons: $full: FAILED (pytest exit status $rc): $counts, $minutes min; see $log")
        tail -n 40 "$log" >&2
    fi
done
printf '%s\n' "${summaries[@]}"
exit "$failed"

#!/usr/bin/env bash
# Run HERE (not on the device) before a device call: puts what benchmarks/device/gpu_check.sh needs into
# two folders that git ignores locally, to be named in the call's `carry`: .whl (pyzmq for the device's
# Python 3.12, the one package roving needs that its image lacks) and .corpus (the Jargon File, which the
# training benchmark reads and the device has no Debian package for).
set -euo pipefail
cd "$(dirname "$0")/../.."
grep -qx '/.whl/' .git/info/exclude || echo '/.whl/' >> .git/info/exclude
grep -qx '/.corpus/' .git/info/exclude || echo '/.corpus/' >> .git/info/exclude
mkdir -p .whl .corpus
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "pyzmq==26.2.0"
cp /usr/share/doc/jargon-text/jargon.txt.gz .corpus/
ls -l .whl .corpus
echo 'device call: run(command="bash benchmarks/device/gpu_check.sh", carry=[".whl", ".corpus"], timeout_s=590)'

#!/usr/bin/env bash
# Installs roving with everything it uses, into the current Python environment.
# PyTorch is pinned first: the CPU build of 2.13.0 is what this project's machines carry; a bare
# `torch` requirement would otherwise pull a multi-GB CUDA build.
. "$(dirname "${BASH_SOURCE[0]}")/fail-loudly.sh"
cd "$(dirname "$0")/.."
python3 -m pip install -q --disable-pip-version-check "torch==2.13.0"
python3 -m pip install -q --disable-pip-version-check -e ".[pipeline,examples,dev,docs]"

#!/usr/bin/env bash
# The one command that runs Lily's tests on a fresh machine: every Rust test
# of the workspace (CPU; GPU tests print a visible skip without a GPU), then
# the end-to-end tests that drive the real `lily serve` binary with the
# official openai Python SDK. Python packages: scripts/requirements-test.txt.
set -euo pipefail
cd "$(dirname "$0")/.."

cargo test --workspace --locked
bash scripts/test-e2e.sh

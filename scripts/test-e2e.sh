#!/usr/bin/env bash
# End-to-end tests of the OpenAI-compatible server: builds the `lily` binary,
# then runs tests/e2e with pytest, which starts `lily serve` on free loopback
# ports with the built-in demo checkpoint and drives it with the official
# `openai` Python SDK. Needs: pip install openai pytest requests
# (scripts/requirements-test.txt). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --locked -p lily
LILY_BIN="${CARGO_TARGET_DIR:-$PWD/target}/debug/lily" python3 -m pytest -q -rs tests/e2e "$@"

#!/usr/bin/env bash
# Certify a deployment end to end (see scripts/verify.py): builds small artifacts and SmolLM2,
# serves them with a real tritonserver, checks over HTTP and gRPC, prints a table, exits 1 on
# any FAIL. Creates .venv/ (the test environment) when it is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed-test
exec .venv/bin/python scripts/verify.py "$@"

#!/usr/bin/env bash
# Certify a deployment end to end: scripts/verify.py builds small artifacts and SmolLM2, serves
# them with a real tritonserver, checks over HTTP and gRPC and prints a table; then
# scripts/abuse.py tries bad input and floods against a served SmolLM2, its generate model and
# `tlaloc openai`, and prints its table. Exits 1 on any FAIL. Creates .venv/ (the test
# environment) when it is missing. Arguments go to verify.py.
set -uo pipefail
cd "$(dirname "$0")/.."
make -s .venv/.installed-test || exit 1
rc=0
.venv/bin/python scripts/verify.py "$@" || rc=1
.venv/bin/python scripts/abuse.py || rc=1
exit $rc

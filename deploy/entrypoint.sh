#!/bin/sh
# tritonserver in a container: every address of the pod (loopback would reach nothing), the
# admin APIs restricted as `tlaloc serve` restricts them (a request to them needs the header
# tlaloc-admin-key with TLALOC_ADMIN_KEY; a random key when unset, so nobody has it), and a
# short exit timeout (an open sequence would hold a graceful stop for the whole timeout).
# Arguments go to tritonserver.
set -eu
if [ -z "${TLALOC_ADMIN_KEY:-}" ]; then
    TLALOC_ADMIN_KEY="$(od -An -N16 -tx1 /dev/urandom | tr -d ' \n')"
fi
rule="model-repository,shared-memory,trace,logging:tlaloc-admin-key=${TLALOC_ADMIN_KEY}"
exec tritonserver \
    --model-repository="${TLALOC_MODEL_REPOSITORY:-/models}" \
    --http-port=8000 --grpc-port=8001 --metrics-port=8002 \
    --http-restricted-api="${rule}" --grpc-restricted-protocol="${rule}" \
    --exit-timeout-secs=5 \
    "$@"

#!/bin/sh
# Runs the reference backend's own tests against real server processes on loopback.
set -eu
cd "$(dirname "$0")"
exec python3 -m unittest -v test_ferry_backend "$@"

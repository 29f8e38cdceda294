#!/usr/bin/env bash
# Every script under scripts/ answers --help (exit 0, its header) and refuses a mistyped option or a bad number
# with one line naming it and exit 2, within seconds: before installing, building or booting anything.
set -uo pipefail
cd "$(dirname "$0")/../.."
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

for script in scripts/*; do
    [[ -f "$script" && -x "$script" ]] || continue
    out=$(timeout 30 "$script" --help 2>&1); rc=$?
    [[ $rc -eq 0 ]] || fail "$script --help exited $rc"
    [[ $(printf '%s\n' "$out" | wc -l) -ge 2 ]] || fail "$script --help printed no usage: '$out'"
done

# refused EXPECTED-TEXT SCRIPT ARGS...: exits 2 within 30 s, and its one line of stderr contains EXPECTED-TEXT.
refused() {
    local expected="$1"; shift
    local err rc
    err=$(timeout 30 "$@" 2>&1 >/dev/null); rc=$?
    [[ $rc -eq 2 ]] || { fail "$* exited $rc, not 2: $err"; return; }
    [[ $(printf '%s\n' "$err" | wc -l) -eq 1 && "$err" == *"$expected"* ]] \
        || fail "$*: expected one line with '$expected', got: $err"
}
for script in bench bench-bluez bench-daemon bench-idle package run run-gateway test-bluez test-daemon test-package; do
    refused "--bogus" "scripts/$script" --bogus
done
refused "takes no arguments" scripts/test --bogus
refused "SECONDS must be a whole number" scripts/fuzz x
for script in bench-decoder bench-ingest bench-replay bench-uplink; do
    refused "must be a whole number" "scripts/$script" 1.5
done
refused "--peripherals needs a whole number ≥ 2" scripts/run --peripherals 1
refused "--events needs a whole number" scripts/run --events 08
refused "--config needs a file" scripts/run --config
refused "--rounds must be a whole number" scripts/bench-bluez --rounds x
refused "--rounds needs a value" scripts/bench-bluez --rounds
refused "--events needs a value" scripts/bench-daemon --events
refused "--idle-seconds must be a number of seconds" scripts/bench-daemon --idle-seconds -1
refused "--window and --ack-every take a whole number" scripts/bench-daemon --window 0

# scripts/run checks its options before installing anything: in a copy of scripts/ whose install-deps only leaves
# a mark, a refused option must leave none.
copy=$(mktemp -d); trap 'rm -rf "$copy"' EXIT
cp -r scripts "$copy/"
printf '#!/bin/sh\ntouch "%s/installed"\n' "$copy" > "$copy/scripts/install-deps"
refused "unknown option '--bogus'" "$copy/scripts/run" --bogus
[[ ! -e "$copy/installed" ]] || fail "scripts/run --bogus ran install-deps before refusing the option"
timeout 30 "$copy/scripts/run" --events 20 --check-options >/dev/null 2>&1 \
    || fail "scripts/run --check-options refused good options"
[[ ! -e "$copy/installed" ]] || fail "scripts/run --check-options ran install-deps (it only checks)"

if [[ $failures -gt 0 ]]; then echo "script options: $failures failure(s)"; exit 1; fi
echo "script options: every script answers --help and refuses bad options"

#!/usr/bin/env bash
# Runs every test: builds Caddy with sluice (./xcaddy.sh) for the binary and
# demo tests, then vet and staticcheck, the race-enabled test suite, and
# last, alone, the smoke run of the bench scripts. (CI fuzzes afterwards:
# .ci/fuzz.sh.)
set -euo pipefail
cd "$(dirname "$0")"

echo "==> gofmt"
unformatted=$(gofmt -l $(git ls-files '*.go' 2>/dev/null || find . -name '*.go'))
if [ -n "$unformatted" ]; then
	echo "gofmt needed on:"; echo "$unformatted"; exit 1
fi
echo "==> go vet"
go vet ./...
# The agent runs on private hosts of any kind: the code and its tests must
# build (and vet) for Windows and macOS too, splicing and TCP_INFO aside.
echo "==> go vet (windows, darwin)"
GOOS=windows go vet ./...
GOOS=darwin go vet ./...
# staticcheck is pinned and installed by .ci/run; a local run without it
# says so and goes on, CI never does.
echo "==> staticcheck"
staticcheck=$(command -v staticcheck || echo "$(go env GOPATH)/bin/staticcheck")
if [ -x "$staticcheck" ]; then
	"$staticcheck" ./...
elif [ -n "${CI:-}" ]; then
	echo "staticcheck not found (CI is set): .ci/run installs it" >&2; exit 1
else
	echo "SKIPPED: staticcheck not installed (go install honnef.co/go/tools/cmd/staticcheck@v0.8.2)"
fi
echo "==> building Caddy with sluice (xcaddy)"
OUTPUT="$PWD/caddy" ./xcaddy.sh
echo "==> go test -race"
SLUICE_CADDY_BIN="$PWD/caddy" go test -race -count=1 -timeout 20m ./... "$@"
# The bench scripts load both CPUs; their smoke test runs alone, after the suite.
echo "==> bench scripts (quick smoke run)"
SLUICE_BENCH_SMOKE=1 SLUICE_CADDY_BIN="$PWD/caddy" go test -count=1 -timeout 10m -run '^TestBenchScriptsRun$' ./integration

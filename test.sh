#!/usr/bin/env bash
# Runs every test: builds Caddy with sluice (./xcaddy.sh) for the binary and
# demo tests, then vet, the race-enabled test suite, and last, alone, the
# smoke run of the bench scripts.
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
echo "==> building Caddy with sluice (xcaddy)"
OUTPUT="$PWD/caddy" ./xcaddy.sh
echo "==> go test -race"
SLUICE_CADDY_BIN="$PWD/caddy" go test -race -count=1 -timeout 20m ./... "$@"
# The bench scripts load both CPUs; their smoke test runs alone, after the suite.
echo "==> bench scripts (quick smoke run)"
SLUICE_BENCH_SMOKE=1 SLUICE_CADDY_BIN="$PWD/caddy" go test -count=1 -timeout 10m -run '^TestBenchScriptsRun$' ./integration

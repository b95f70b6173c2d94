#!/usr/bin/env bash
# Builds ./caddy: Caddy v2.11.9 with this checkout's sluice modules and caddy-l4.
#
#   ./xcaddy.sh            # writes ./caddy
#   OUTPUT=/tmp/caddy ./xcaddy.sh
#
# xcaddy resolves the local replacement through `go get`; on networks where
# only the Go module proxy is reachable a "direct" fallback hangs, so the
# proxy list is reduced to its first entry followed by "|off".
set -euo pipefail
cd "$(dirname "$0")"

CADDY_VERSION=v2.11.9
CADDY_L4_VERSION=v0.1.2
XCADDY_VERSION=v0.4.5
OUTPUT=${OUTPUT:-$PWD/caddy}

GOBIN_DIR=$(go env GOPATH)/bin
if ! command -v xcaddy >/dev/null 2>&1 && [ ! -x "$GOBIN_DIR/xcaddy" ]; then
	go install "github.com/caddyserver/xcaddy/cmd/xcaddy@${XCADDY_VERSION}"
fi
XCADDY=$(command -v xcaddy 2>/dev/null || echo "$GOBIN_DIR/xcaddy")

first_proxy=$(go env GOPROXY | cut -d, -f1 | cut -d'|' -f1)
if [ -n "$first_proxy" ] && [ "$first_proxy" != "direct" ] && [ "$first_proxy" != "off" ]; then
	export GOPROXY="${first_proxy}|off"
fi

XCADDY_SKIP_CLEANUP=0 "$XCADDY" build "$CADDY_VERSION" \
	--output "$OUTPUT" \
	--with "github.com/sluice-tunnel/sluice=$PWD" \
	--with "github.com/mholt/caddy-l4@${CADDY_L4_VERSION}"

"$OUTPUT" list-modules 2>/dev/null | grep -E '^(sluice|http\.handlers\.sluice|http\.reverse_proxy\.(upstreams|transport)\.sluice)$' >/dev/null \
	|| { echo "xcaddy.sh: built binary lacks the sluice modules" >&2; exit 1; }
echo "built $OUTPUT"

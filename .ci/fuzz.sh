#!/usr/bin/env bash
# Fuzzes each target for a bounded time (FUZZTIME, 15s by default). The
# committed corpora (<package>/testdata/fuzz/<Target>/) already run as seeds
# in the ordinary `go test`; this looks for new failures. go test -fuzz takes
# one target per run. A target that fails writes its input to
# <package>/testdata/fuzz/<Target>/: after the fix, commit it as a
# regression seed. Any failure, or a target missing from its package, fails
# the script (and CI).
set -euo pipefail
cd "$(dirname "$0")/.."

fuzztime=${FUZZTIME:-15s}

# package target
targets=(
	"./proto FuzzUnmarshalEnvelope"
	"./proto FuzzParsePrefaces"
	"./agent FuzzParseConfig"
	"./agent FuzzMisbehavingNode"
	"./tunnelcore FuzzMisbehavingPeer"
	"./tunnelcore FuzzLaneReader"
	"./caddymodule FuzzValidateRoutes"
)

# fuzz_one fuzzes one target. Go's fuzzing engine sometimes ends a run
# with "context deadline exceeded" as -fuzztime runs out while a worker is
# busy, with no failing input: that run is tried again (twice at most). A
# real failure always writes its input ("Failing input written to") and
# fails at once.
fuzz_one() {
	local pkg=$1 name=$2 out
	for attempt in 1 2 3; do
		echo "==> fuzz $pkg $name ($fuzztime)"
		out=$(go test -run '^$' -fuzz "^${name}\$" -fuzztime "$fuzztime" "$pkg" 2>&1) && { echo "$out"; return 0; }
		echo "$out"
		if grep -q "Failing input written to" <<<"$out" || ! grep -q "context deadline exceeded" <<<"$out"; then
			return 1
		fi
		echo "fuzz: $name: the engine's deadline hiccup, no failing input (attempt $attempt); again" >&2
	done
	return 1
}

failed=()
for t in "${targets[@]}"; do
	read -r pkg name <<<"$t"
	# A renamed or removed target would otherwise fuzz nothing and pass.
	listed=$(go test -list "^${name}\$" "$pkg")
	if ! grep -qx "$name" <<<"$listed"; then
		echo "fuzz: $name not found in $pkg" >&2
		failed+=("$pkg $name (missing)")
		continue
	fi
	if ! fuzz_one "$pkg" "$name"; then
		failed+=("$pkg $name")
	fi
done

if [ ${#failed[@]} -gt 0 ]; then
	echo "fuzzing failed:" >&2
	printf '  %s\n' "${failed[@]}" >&2
	git status --short -- '*/testdata/fuzz/' >&2 || true
	exit 1
fi

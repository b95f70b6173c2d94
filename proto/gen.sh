#!/usr/bin/env bash
# Regenerates tunnel.pb.go and tunnel_grpc.pb.go from tunnel.proto.
#
# Pinned tools (the versions in the headers of the committed files):
#   protoc              3.21.12 ("libprotoc 3.21.12"; another version only
#                       changes the "protoc" line of the headers, with a warning)
#   protoc-gen-go       v1.36.12
#   protoc-gen-go-grpc  v1.6.2
#
# protoc must be on PATH (Debian/Ubuntu: apt-get install protobuf-compiler).
# The plugins are taken from PATH or $(go env GOBIN) / $(go env GOPATH)/bin
# when their version matches; otherwise they are installed with
# `go install ...@version` into a temporary GOBIN that is removed afterwards.
#
# proto/generate_test.go (TestGeneratedCodeIsCurrent) fails when the
# committed files differ from what this script produces.
set -euo pipefail

PROTOC_VERSION="3.21.12"
PROTOC_GEN_GO_VERSION="v1.36.12"
PROTOC_GEN_GO_GRPC_VERSION="v1.6.2"

cd "$(dirname "${BASH_SOURCE[0]}")"

if ! command -v protoc >/dev/null 2>&1; then
	echo "gen.sh: protoc not found on PATH (want libprotoc ${PROTOC_VERSION})" >&2
	exit 1
fi
have_protoc="$(protoc --version)"
if [[ "${have_protoc}" != "libprotoc ${PROTOC_VERSION}" ]]; then
	echo "gen.sh: warning: ${have_protoc} is not libprotoc ${PROTOC_VERSION}; the generated headers will name it" >&2
fi

tmpbin=""
cleanup() {
	if [[ -n "${tmpbin}" ]]; then
		chmod -R u+w "${tmpbin}" 2>/dev/null || true
		rm -rf "${tmpbin}"
	fi
}
trap cleanup EXIT

# plugin_version PATH prints the version the plugin at PATH reports, as vX.Y.Z.
plugin_version() {
	local out
	out="$("$1" --version 2>/dev/null || true)"
	out="${out##* }"        # "protoc-gen-go v1.36.12" / "protoc-gen-go-grpc 1.6.2"
	[[ -z "${out}" ]] && return 0
	[[ "${out}" == v* ]] || out="v${out}"
	printf '%s\n' "${out}"
}

# find_plugin NAME VERSION PACKAGE sets plugin to the path of NAME at
# VERSION, installing PACKAGE@VERSION into a temporary GOBIN when none is
# found. (It sets a variable rather than printing, so that tmpbin is known
# to the cleanup trap of this shell.)
plugin=""
find_plugin() {
	local name="$1" version="$2" pkg="$3" dir
	local -a dirs=()
	IFS=: read -r -a dirs <<<"${PATH}"
	if command -v go >/dev/null 2>&1; then
		local gobin gopath
		local -a gp=()
		gobin="$(go env GOBIN)"
		[[ -n "${gobin}" ]] && dirs+=("${gobin}")
		gopath="$(go env GOPATH)"
		IFS=: read -r -a gp <<<"${gopath}"
		for dir in "${gp[@]}"; do dirs+=("${dir}/bin"); done
	fi
	for dir in "${dirs[@]}"; do
		plugin="${dir}/${name}"
		if [[ -x "${plugin}" && "$(plugin_version "${plugin}")" == "${version}" ]]; then
			return 0
		fi
	done
	if ! command -v go >/dev/null 2>&1; then
		echo "gen.sh: ${name} ${version} not found and go is not on PATH to install it" >&2
		exit 1
	fi
	if [[ -z "${tmpbin}" ]]; then
		tmpbin="$(mktemp -d)"
	fi
	echo "gen.sh: installing ${pkg}@${version} into a temporary GOBIN" >&2
	GOBIN="${tmpbin}" GOFLAGS= go install "${pkg}@${version}"
	plugin="${tmpbin}/${name}"
}

find_plugin protoc-gen-go "${PROTOC_GEN_GO_VERSION}" google.golang.org/protobuf/cmd/protoc-gen-go
protoc_gen_go="${plugin}"
find_plugin protoc-gen-go-grpc "${PROTOC_GEN_GO_GRPC_VERSION}" google.golang.org/grpc/cmd/protoc-gen-go-grpc
protoc_gen_go_grpc="${plugin}"

protoc \
	--plugin=protoc-gen-go="${protoc_gen_go}" \
	--plugin=protoc-gen-go-grpc="${protoc_gen_go_grpc}" \
	--go_out=. --go_opt=paths=source_relative \
	--go-grpc_out=. --go-grpc_opt=paths=source_relative \
	tunnel.proto

echo "gen.sh: regenerated proto/tunnel.pb.go and proto/tunnel_grpc.pb.go" >&2

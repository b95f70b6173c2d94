// Package tunnelpb owns sluice's wire contract: tunnel.proto and the code
// generated from it (committed; proto/gen.sh regenerates it and
// TestGeneratedCodeIsCurrent checks it), and Codec, the gRPC codec that
// carries DATA payloads as mem.Buffers without copying them through
// protobuf. README.md beside this file is the normative protocol
// specification.
package tunnelpb

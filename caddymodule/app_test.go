package caddymodule

import (
	"net"
	"os"
	"path/filepath"
	"testing"
)

// TestTokenFileDropsAByteOrderMark: a token file saved with a BOM (and a
// CRLF) gives the token without them, as the agent reads the same file.
func TestTokenFileDropsAByteOrderMark(t *testing.T) {
	path := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(path, []byte("\xef\xbb\xbfs3cret-token\r\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a := &App{TokenFile: path}
	got, err := a.resolveToken()
	if err != nil || got != "s3cret-token" {
		t.Fatalf("resolveToken = %q, %v; want \"s3cret-token\"", got, err)
	}
}

// TestPlaintextWarningOnlyBeyondLoopback: the plaintext warning is for a
// control plane that listens beyond loopback (the default :8001 does).
func TestPlaintextWarningOnlyBeyondLoopback(t *testing.T) {
	for _, tc := range []struct {
		addr net.Addr
		want bool
	}{
		{&net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: 8001}, false},
		{&net.TCPAddr{IP: net.ParseIP("::1"), Port: 8001}, false},
		{&net.TCPAddr{IP: net.IPv6unspecified, Port: 8001}, true},
		{&net.TCPAddr{IP: net.IPv4zero, Port: 8001}, true},
		{&net.TCPAddr{IP: net.ParseIP("192.0.2.1"), Port: 8001}, true},
		{&net.UnixAddr{Name: "/run/sluice.sock", Net: "unix"}, false},
	} {
		if got := reachableBeyondHost(tc.addr); got != tc.want {
			t.Errorf("reachableBeyondHost(%v) = %v, want %v", tc.addr, got, tc.want)
		}
	}
}

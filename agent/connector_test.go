package agent

import (
	"bytes"
	"testing"
)

func TestProxyHeaderV1(t *testing.T) {
	for _, tc := range []struct{ src, dst, want string }{
		{"203.0.113.7:5555", "198.51.100.1:443", "PROXY TCP4 203.0.113.7 198.51.100.1 5555 443\r\n"},
		{"[2001:db8::1]:5555", "[2001:db8::2]:443", "PROXY TCP6 2001:db8::1 2001:db8::2 5555 443\r\n"},
		{"[::ffff:203.0.113.7]:5555", "198.51.100.1:443", "PROXY TCP4 203.0.113.7 198.51.100.1 5555 443\r\n"},
		{"203.0.113.7:5555", "[2001:db8::2]:443", "PROXY TCP6 ::ffff:203.0.113.7 2001:db8::2 5555 443\r\n"},
		{"203.0.113.7:5555", "", "PROXY TCP4 203.0.113.7 0.0.0.0 5555 0\r\n"},
		{"", "198.51.100.1:443", "PROXY UNKNOWN\r\n"},
		{"example.com:80", "198.51.100.1:443", "PROXY UNKNOWN\r\n"},
		{"203.0.113.7", "198.51.100.1:443", "PROXY UNKNOWN\r\n"},
	} {
		if got := string(proxyHeaderV1(tc.src, tc.dst)); got != tc.want {
			t.Errorf("v1(%q, %q) = %q, want %q", tc.src, tc.dst, got, tc.want)
		}
	}
}

func TestProxyHeaderV2(t *testing.T) {
	sig := []byte{0x0D, 0x0A, 0x0D, 0x0A, 0x00, 0x0D, 0x0A, 0x51, 0x55, 0x49, 0x54, 0x0A}
	cat := func(parts ...[]byte) []byte { return bytes.Join(parts, nil) }
	v4 := cat(sig, []byte{0x21, 0x11, 0x00, 0x0C,
		203, 0, 113, 7, 198, 51, 100, 1,
		0x15, 0xB3, 0x01, 0xBB})
	v6 := cat(sig, []byte{0x21, 0x21, 0x00, 0x24},
		[]byte{0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 1},
		[]byte{0x20, 0x01, 0x0d, 0xb8, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2},
		[]byte{0x15, 0xB3, 0x01, 0xBB})
	local := cat(sig, []byte{0x20, 0x00, 0x00, 0x00})
	for _, tc := range []struct {
		src, dst string
		want     []byte
	}{
		{"203.0.113.7:5555", "198.51.100.1:443", v4},
		{"[2001:db8::1]:5555", "[2001:db8::2]:443", v6},
		{"", "", local},
		{"not an address", "198.51.100.1:443", local},
	} {
		if got := proxyHeaderV2(tc.src, tc.dst); !bytes.Equal(got, tc.want) {
			t.Errorf("v2(%q, %q) =\n% x\nwant\n% x", tc.src, tc.dst, got, tc.want)
		}
	}
}

func TestUpstreamServerName(t *testing.T) {
	for _, tc := range []struct{ rewrite, hostport, want string }{
		{"", "127.0.0.1:8443", "127.0.0.1"},
		{"", "[::1]:8443", "::1"},
		{"app.local", "10.0.0.5:8443", "app.local"},
		{"app.local:8443", "10.0.0.5:8443", "app.local"},
	} {
		if got := upstreamServerName(tc.rewrite, tc.hostport); got != tc.want {
			t.Errorf("upstreamServerName(%q, %q) = %q, want %q", tc.rewrite, tc.hostport, got, tc.want)
		}
	}
}

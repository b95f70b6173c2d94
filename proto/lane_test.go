package tunnelpb

import (
	"bytes"
	"errors"
	"strings"
	"testing"
)

const (
	testTicket = "0123456789abcdef0123456789abcdef"
	testKey    = "fedcba9876543210fedcba9876543210"
)

func TestParseLaneHello(t *testing.T) {
	good := string(LaneHello(testTicket))
	for _, tc := range []struct {
		name, in string
		ok       bool
	}{
		{"what LaneHello writes", good, true},
		{"all zeros", LanePreface + strings.Repeat("0", 32) + "\n", true},
		{"upper-case ticket", LanePreface + strings.ToUpper(testTicket) + "\n", false},
		{"non-hex ticket", LanePreface + strings.Repeat("g", 32) + "\n", false},
		{"ticket with a space", LanePreface + " " + testTicket[1:] + "\n", false},
		{"short ticket", LanePreface + testTicket[1:] + "\n", false},
		{"long ticket", LanePreface + testTicket + "0\n", false},
		{"no newline", LanePreface + testTicket + "\r", false},
		{"CRLF", LanePreface + testTicket[1:] + "\r\n", false},
		{"other version", strings.Replace(good, "/1", "/9", 1), false},
		{"direct preface", DirectPreface + testTicket + "\n", false},
		{"a direct socket's hello", string(DirectHello(testKey, 1)), false},
		{"empty", "", false},
		{"preface alone", LanePreface, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			ticket, err := ParseLaneHello([]byte(tc.in))
			if !tc.ok {
				if err == nil || !errors.Is(err, ErrMalformedHello) {
					t.Fatalf("ParseLaneHello(%q) = %q, %v; want ErrMalformedHello", tc.in, ticket, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseLaneHello(%q): %v", tc.in, err)
			}
			if got := string(LaneHello(ticket)); got != tc.in {
				t.Errorf("LaneHello(%q) = %q, want %q", ticket, got, tc.in)
			}
		})
	}
}

func TestParseDirectHello(t *testing.T) {
	good := string(DirectHello(testKey, 0x1234))
	withID := func(id string) string { return DirectPreface + testKey + id + "\n" }
	for _, tc := range []struct {
		name, in string
		ok       bool
		id       uint64
	}{
		{"what DirectHello writes", good, true, 0x1234},
		{"largest id", string(DirectHello(testKey, ^uint64(0))), true, ^uint64(0)},
		{"id 0", withID(strings.Repeat("0", 16)), false, 0},
		{"upper-case id", withID("00000000000000AB"), false, 0},
		{"signed id", withID("+000000000000001"), false, 0},
		{"0x id", withID("0x00000000000001"), false, 0},
		{"underscore id", withID("0000000000_00001"), false, 0},
		{"upper-case key", DirectPreface + strings.ToUpper(testKey) + "0000000000000001\n", false, 0},
		{"non-hex key", DirectPreface + strings.Repeat("z", 32) + "0000000000000001\n", false, 0},
		{"no newline", good[:len(good)-1] + " ", false, 0},
		{"short", good[1:], false, 0},
		{"long", good + "\n", false, 0},
		{"lane preface", LanePreface + good[len(DirectPreface):], false, 0},
		{"empty", "", false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			key, id, err := ParseDirectHello([]byte(tc.in))
			if !tc.ok {
				if err == nil || !errors.Is(err, ErrMalformedHello) {
					t.Fatalf("ParseDirectHello(%q) = %q, %d, %v; want ErrMalformedHello", tc.in, key, id, err)
				}
				return
			}
			if err != nil {
				t.Fatalf("ParseDirectHello(%q): %v", tc.in, err)
			}
			if key != testKey || id != tc.id {
				t.Errorf("ParseDirectHello(%q) = %q, %d; want %q, %d", tc.in, key, id, testKey, tc.id)
			}
		})
	}
}

// TestHelloLengths pins the lengths proto/README §2.4 and §2.5 give.
func TestHelloLengths(t *testing.T) {
	if LaneHelloLength != 47 || len(LaneHello(testTicket)) != LaneHelloLength {
		t.Errorf("lane hello length %d, want 47", LaneHelloLength)
	}
	if DirectHelloLength != 63 || len(DirectHello(testKey, 1)) != DirectHelloLength {
		t.Errorf("direct hello length %d, want 63", DirectHelloLength)
	}
	// A listener reads one prefix and then tells the two apart.
	if len(LanePreface) != len(DirectPreface) || LanePreface[0] != DirectPreface[0] {
		t.Errorf("prefaces %q and %q differ in length or first byte", LanePreface, DirectPreface)
	}
}

// FuzzParsePrefaces: the preface parsers never panic, and whatever they
// accept is exactly what LaneHello or DirectHello writes for what they
// returned, so one ticket, key or connection has one spelling on the wire.
// Each input is also tried after each preface, where the mutations that
// matter (of the ticket, key and id) are more likely to land.
func FuzzParsePrefaces(f *testing.F) {
	f.Add(LaneHello(testTicket))
	f.Add(LaneHello(strings.ToUpper(testTicket)))
	f.Add(DirectHello(testKey, 1))
	f.Add(DirectHello(testKey, ^uint64(0)))
	f.Add([]byte(DirectPreface + testKey + "000000000000000A\n"))
	f.Add([]byte(DirectPreface + testKey + "0000000000000000\n"))
	f.Add([]byte("PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"))
	f.Add([]byte(testTicket + "\n"))              // after LanePreface
	f.Add([]byte(testKey + "00000000000000ff\n")) // after DirectPreface
	f.Fuzz(func(t *testing.T, b []byte) {
		checkPrefaceRoundTrip(t, b)
		checkPrefaceRoundTrip(t, append([]byte(LanePreface), b...))
		checkPrefaceRoundTrip(t, append([]byte(DirectPreface), b...))
	})
}

// checkPrefaceRoundTrip checks FuzzParsePrefaces' property on b.
func checkPrefaceRoundTrip(t *testing.T, b []byte) {
	t.Helper()
	if ticket, err := ParseLaneHello(b); err == nil {
		if got := LaneHello(ticket); !bytes.Equal(got, b) {
			t.Fatalf("ParseLaneHello(%q) = %q, which LaneHello writes as %q", b, ticket, got)
		}
		if len(ticket) != LaneTicketLength {
			t.Fatalf("ParseLaneHello(%q): ticket %q of length %d", b, ticket, len(ticket))
		}
	} else if !errors.Is(err, ErrMalformedHello) {
		t.Fatalf("ParseLaneHello(%q): error %v is not ErrMalformedHello", b, err)
	}
	if key, id, err := ParseDirectHello(b); err == nil {
		if got := DirectHello(key, id); !bytes.Equal(got, b) {
			t.Fatalf("ParseDirectHello(%q) = %q, %d, which DirectHello writes as %q", b, key, id, got)
		}
		if id == 0 || len(key) != DirectKeyLength {
			t.Fatalf("ParseDirectHello(%q) = %q, %d", b, key, id)
		}
	} else if !errors.Is(err, ErrMalformedHello) {
		t.Fatalf("ParseDirectHello(%q): error %v is not ErrMalformedHello", b, err)
	}
}

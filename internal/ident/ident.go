// Package ident owns the rules both ends of the tunnel apply to what an
// agent presents: its id (Advertise.agent_id and the x-sluice-id header)
// and its token (the Authorization header). Both travel as gRPC metadata,
// which takes printable ASCII only, and the id appears in the node's logs.
package ident

import (
	"fmt"
	"strings"
)

// MaxIDLength is the longest agent id.
const MaxIDLength = 128

// CheckID accepts an agent id of at most MaxIDLength bytes of printable
// ASCII without spaces (0x21-0x7E).
func CheckID(id string) error {
	if len(id) > MaxIDLength {
		return fmt.Errorf("longer than %d bytes", MaxIDLength)
	}
	if i, r, bad := firstOutside(id, false); bad {
		return fmt.Errorf("%q: must be printable ASCII without spaces (found %U at byte %d)", id, r, i)
	}
	return nil
}

// CheckToken accepts a token of printable ASCII, inner spaces included
// (0x20-0x7E). The error never quotes the token: it is a secret.
func CheckToken(token string) error {
	if i, r, bad := firstOutside(token, true); bad {
		return fmt.Errorf("must be printable ASCII (found %U at byte %d)", r, i)
	}
	return nil
}

// TrimToken drops a leading UTF-8 byte order mark (which editors on
// Windows write at the start of a file) and surrounding white space.
func TrimToken(s string) string {
	return strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(s), "\uFEFF"))
}

// firstOutside finds the first rune of s outside printable ASCII (spaces
// allowed or not).
func firstOutside(s string, spaces bool) (int, rune, bool) {
	for i, r := range s {
		if r == ' ' && spaces {
			continue
		}
		if r < 0x21 || r > 0x7e {
			return i, r, true
		}
	}
	return 0, 0, false
}

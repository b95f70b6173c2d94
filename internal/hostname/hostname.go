// Package hostname owns the rules both ends of the tunnel apply to host
// names and host patterns: what a route may advertise and what the node
// will route, so an agent refuses at start what the node would reject at
// its Advertise.
package hostname

import (
	"fmt"
	"net/netip"
	"regexp"
	"regexp/syntax"
	"strings"
	"unicode"
)

// Bounds on host names and patterns. Every pattern runs for each request
// whose host no exact route serves, so its size bounds the node's CPU per
// request as well as its memory.
const (
	// MaxLength is the longest DNS name routed (RFC 1035).
	MaxLength = 253
	// MaxPatternLength bounds a host_pattern's source.
	MaxPatternLength = 1024
	// MaxPatternInsts bounds its compiled program (regexp/syntax
	// instructions: a{1000} repeats its operand a thousand times).
	// [a-z0-9-]+\.dev\.example\.com compiles to 40.
	MaxPatternInsts = 2000
)

// Valid reports whether h is a lower-case DNS name of labels of letters,
// digits, '-' and '_' (1-63 bytes each, MaxLength in all) without a
// trailing dot, or an IPv4 address, which is such a name too.
func Valid(h string) bool { return checkName(h) == nil }

// Check is ValidRoute with the reason: nil for a lower-case DNS name or an
// IP address without brackets or port.
func Check(h string) error {
	if strings.Contains(h, ":") {
		if ValidRoute(h) {
			return nil
		}
		if _, err := netip.ParseAddr(h); err == nil {
			return fmt.Errorf("%q: an IPv6 address must be lower case", h)
		}
		return fmt.Errorf("%q: no port allowed (use the bare host name)", h)
	}
	return checkName(h)
}

func checkName(h string) error {
	if h == "" {
		return fmt.Errorf("empty host name")
	}
	if len(h) > MaxLength {
		return fmt.Errorf("%q is longer than %d bytes", h, MaxLength)
	}
	for label := range strings.SplitSeq(h, ".") {
		if len(label) == 0 {
			return fmt.Errorf("%q has an empty label", h)
		}
		if len(label) > 63 {
			return fmt.Errorf("%q has a label longer than 63 bytes", h)
		}
		for i := 0; i < len(label); i++ {
			c := label[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-' || c == '_') {
				return fmt.Errorf("%q: invalid character %q (want a lower-case host name; use host_pattern for patterns)", h, rune(c))
			}
		}
	}
	return nil
}

// ValidRoute reports whether a route's host can ever equal a request's
// routing key: a Valid name or a lower-case IPv6 address without brackets.
func ValidRoute(h string) bool {
	if a, err := netip.ParseAddr(h); err == nil && a.Is6() {
		return strings.ToLower(h) == h
	}
	return Valid(h)
}

// RoutingKey validates a request's Host and returns the key routes are
// looked up by: the host lowercased, without port, brackets or the trailing
// dot of a fully qualified name. ok is false for anything else (a second
// port, an empty label, percent-encoding, a name over MaxLength): such a
// Host must not fall through to a pattern or catch-all route whose upstream
// might read it as the host it resembles. An empty Host (HTTP/1.0) is
// valid and routes to the catch-all.
func RoutingKey(hostport string) (host string, ok bool) {
	h := hostport
	if strings.HasPrefix(h, "[") {
		end := strings.IndexByte(h, ']')
		if end < 0 || !validPort(h[end+1:]) {
			return "", false
		}
		a, err := netip.ParseAddr(h[1:end])
		if err != nil || !a.Is6() {
			return "", false
		}
		return strings.ToLower(h[1:end]), true
	}
	if i := strings.IndexByte(h, ':'); i >= 0 {
		if a, err := netip.ParseAddr(h); err == nil && a.Is6() {
			return strings.ToLower(h), true // a bare IPv6 literal
		}
		if !validPort(h[i:]) {
			return "", false
		}
		h = h[:i]
	}
	h = strings.ToLower(strings.TrimSuffix(h, "."))
	return h, h == "" || Valid(h)
}

// validPort reports whether s is empty or ":" followed by up to 5 digits
// (RFC 9110 allows an empty port).
func validPort(s string) bool {
	if s == "" || s == ":" {
		return true
	}
	if s[0] != ':' || len(s) > 6 {
		return false
	}
	for _, c := range s[1:] {
		if c < '0' || c > '9' {
			return false
		}
	}
	return true
}

// CompilePattern compiles a host pattern to match whole host names and
// returns the size of its compiled program. p must parse on its own, so it
// cannot close the anchors put around it (`x)|(.*` would otherwise match
// every host), and stay within MaxPatternLength and MaxPatternInsts.
func CompilePattern(p string) (*regexp.Regexp, int, error) {
	if len(p) > MaxPatternLength {
		return nil, 0, fmt.Errorf("longer than %d bytes", MaxPatternLength)
	}
	if _, err := syntax.Parse(p, syntax.Perl); err != nil {
		return nil, 0, err
	}
	whole := "^(?:" + p + ")$"
	re, err := syntax.Parse(whole, syntax.Perl)
	if err != nil {
		return nil, 0, err
	}
	prog, err := syntax.Compile(re.Simplify())
	if err != nil {
		return nil, 0, err
	}
	if n := len(prog.Inst); n > MaxPatternInsts {
		return nil, 0, fmt.Errorf("too complex (%d instructions compiled, at most %d)", n, MaxPatternInsts)
	}
	compiled, err := regexp.Compile(whole)
	return compiled, len(prog.Inst), err
}

// UpperCaseLiteral returns an upper-case letter p matches literally and
// case-sensitively, or 0. Hosts are matched lower-cased, so such a pattern
// never matches where its author expects (`App\.example\.com`); classes and
// escapes such as \S or \pL are not literals and pass.
func UpperCaseLiteral(p string) rune {
	re, err := syntax.Parse(p, syntax.Perl)
	if err != nil {
		return 0
	}
	return upperLiteral(re)
}

func upperLiteral(re *syntax.Regexp) rune {
	if re.Op == syntax.OpLiteral && re.Flags&syntax.FoldCase == 0 {
		for _, r := range re.Rune {
			if unicode.IsUpper(r) {
				return r
			}
		}
	}
	for _, sub := range re.Sub {
		if r := upperLiteral(sub); r != 0 {
			return r
		}
	}
	return 0
}

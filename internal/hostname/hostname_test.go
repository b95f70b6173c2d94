package hostname

import (
	"strings"
	"testing"
)

func TestValid(t *testing.T) {
	for _, h := range []string{"app.test", "a_b.internal", "10.0.0.1", "xn--bcher-kva.example", strings.Repeat("a", 63) + ".com"} {
		if !Valid(h) {
			t.Errorf("Valid(%q) = false", h)
		}
	}
	for _, h := range []string{"", "App.test", "app.test.", "a..b", ".a", "a b", "a%2eb", "::1", strings.Repeat("a", 64) + ".com", strings.Repeat("abcdefghi.", 26) + "com"} {
		if Valid(h) {
			t.Errorf("Valid(%q) = true", h)
		}
	}
	if !ValidRoute("::1") || !ValidRoute("fe80::1") || ValidRoute("FE80::1") || ValidRoute("[::1]") {
		t.Error("ValidRoute: IPv6 addresses are accepted lower-case, without brackets")
	}
}

func TestCompilePattern(t *testing.T) {
	re, n, err := CompilePattern(`[a-z0-9-]+\.dev\.example\.com`)
	if err != nil || n == 0 || !re.MatchString("x-1.dev.example.com") || re.MatchString("x.dev.example.com.evil") {
		t.Fatalf("an ordinary pattern: %v, %d instructions", err, n)
	}
	for p, want := range map[string]string{
		`never\.example)|(.*`:                   "unexpected )",
		`(?:.*a){1000}`:                         "too complex",
		strings.Repeat("a", MaxPatternLength+1): "longer than",
	} {
		if _, _, err := CompilePattern(p); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("CompilePattern(%.30q): %v, want an error with %q", p, err, want)
		}
	}
}

func TestUpperCaseLiteral(t *testing.T) {
	for p, want := range map[string]rune{
		`App\.example\.com`:             'A',
		`[a-z]+\.example\.com`:          0,
		`(?i)App\.example\.com`:         0,
		`\S+\.example\.com`:             0,
		`\pL+\.example\.com`:            0,
		`(?P<sub>[a-z]+)\.example\.com`: 0,
		`(?P<sub>[a-z]+)\.Example\.com`: 'E',
	} {
		if got := UpperCaseLiteral(p); got != want {
			t.Errorf("UpperCaseLiteral(%q) = %q, want %q", p, got, want)
		}
	}
}

// TestRoutingKey: the forms of Host a request may carry, and those that
// must reach no route.
func TestRoutingKey(t *testing.T) {
	for in, want := range map[string]string{
		"App.Test:8080": "app.test", "app.test.": "app.test", "[::1]:80": "::1", "::1": "::1", "[::1]": "::1",
		"10.0.0.1:443": "10.0.0.1", "a_b.internal": "a_b.internal", "": "", "app.test:": "app.test",
	} {
		if got, ok := RoutingKey(in); !ok || got != want {
			t.Errorf("RoutingKey(%q) = %q, %v; want %q, true", in, got, ok, want)
		}
	}
	for _, in := range []string{
		"admin.example.com..", "admin.example.com:80:80", "admin%2eexample.com", ".example.com", "a..b",
		"app.test:http", "app.test:123456", "[::1", "[10.0.0.1]", "[::1]x", "exa mple.com",
		strings.Repeat("a", 64) + ".com", strings.Repeat("abcdefghi.", 26) + "com",
	} {
		if got, ok := RoutingKey(in); ok {
			t.Errorf("RoutingKey(%q) = %q, true; want invalid", in, got)
		}
	}
}

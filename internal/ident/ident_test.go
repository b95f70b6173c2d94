package ident

import (
	"strings"
	"testing"
)

func TestCheckID(t *testing.T) {
	for _, id := range []string{"office-nas", "agent-0123456789ab", strings.Repeat("x", MaxIDLength)} {
		if err := CheckID(id); err != nil {
			t.Errorf("CheckID(%q): %v", id, err)
		}
	}
	for id, want := range map[string]string{
		strings.Repeat("x", MaxIDLength+1): "longer than 128 bytes",
		"two words":                        "without spaces (found U+0020 at byte 3)",
		"b\u00fcro":                        "found U+00FC at byte 1",
		"nul\x00":                          "found U+0000",
	} {
		if err := CheckID(id); err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("CheckID(%.20q) = %v, want an error with %q", id, err, want)
		}
	}
}

func TestCheckTokenAndTrim(t *testing.T) {
	if err := CheckToken("correct horse battery staple"); err != nil {
		t.Errorf("inner spaces: %v", err)
	}
	err := CheckToken("s\u00e9cret")
	if err == nil || !strings.Contains(err.Error(), "found U+00E9 at byte 1") || strings.Contains(err.Error(), "cret") {
		t.Errorf("non-ASCII token: %v (must name the byte, not quote the token)", err)
	}
	if got := TrimToken("\ufeffs3cret \r\n"); got != "s3cret" {
		t.Errorf("TrimToken = %q", got)
	}
}

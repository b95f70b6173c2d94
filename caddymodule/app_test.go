package caddymodule

import (
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

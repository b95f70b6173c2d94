// Package adapttest runs golden Caddyfile→JSON adapt tests, as Caddy's and
// caddy-l4's own do: each testdata file holds a Caddyfile, a line of ten
// dashes, and the JSON it must adapt to (tab-indented). `go test -update`
// rewrites the golden halves. The caller imports the modules its files use.
package adapttest

import (
	"bytes"
	"encoding/json"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

var update = flag.Bool("update", false, "rewrite the golden adapt files with the current output")

// Separator divides a golden file's Caddyfile from its JSON.
const Separator = "----------"

// Run checks every file matching glob.
func Run(t *testing.T, glob string) {
	t.Helper()
	files, _ := filepath.Glob(glob)
	if len(files) == 0 {
		t.Fatalf("no golden files match %s", glob)
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			in, want, _ := strings.Cut(string(raw), Separator)
			in = strings.TrimSpace(in) + "\n"
			got := Adapt(t, in)
			if *update {
				if err := os.WriteFile(f, []byte(in+Separator+"\n"+got+"\n"), 0o644); err != nil {
					t.Fatal(err)
				}
				return
			}
			if got != strings.TrimSpace(want) {
				t.Errorf("adapted JSON differs\ngot:\n%s\nwant:\n%s", got, strings.TrimSpace(want))
			}
		})
	}
}

// Adapt adapts a Caddyfile to tab-indented JSON, failing the test on error.
func Adapt(t *testing.T, caddyfileText string) string {
	t.Helper()
	out, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(caddyfileText), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	var b bytes.Buffer
	if err := json.Indent(&b, out, "", "\t"); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

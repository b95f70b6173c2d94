package caddymodule

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
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	_ "github.com/caddyserver/caddy/v2/modules/caddytls"
)

var update = flag.Bool("update", false, "rewrite the golden adapt files with the current output")

const goldenSeparator = "----------"

// TestCaddyfileAdapt adapts every testdata/adapt/*.caddytest Caddyfile and
// compares the JSON with the golden part after the separator, as Caddy's
// and caddy-l4's adapt tests do.
func TestCaddyfileAdapt(t *testing.T) {
	files, _ := filepath.Glob("testdata/adapt/*.caddytest")
	if len(files) == 0 {
		t.Fatal("no golden files")
	}
	for _, f := range files {
		t.Run(filepath.Base(f), func(t *testing.T) {
			raw, err := os.ReadFile(f)
			if err != nil {
				t.Fatal(err)
			}
			in, want, _ := strings.Cut(string(raw), goldenSeparator)
			got := adapt(t, strings.TrimSpace(in)+"\n")
			if *update {
				os.WriteFile(f, []byte(strings.TrimSpace(in)+"\n"+goldenSeparator+"\n"+got+"\n"), 0o644)
				return
			}
			if got != strings.TrimSpace(want) {
				t.Errorf("adapted JSON differs\ngot:\n%s\nwant:\n%s", got, strings.TrimSpace(want))
			}
		})
	}
}

func adapt(t *testing.T, in string) string {
	t.Helper()
	out, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	var b bytes.Buffer
	if err := json.Indent(&b, out, "", "\t"); err != nil {
		t.Fatal(err)
	}
	return b.String()
}

// TestCaddyfileErrors: invalid Caddyfiles fail at adapt time, naming what is wrong.
func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"directive args", ":80 {\n\tsluice localhost:3000\n}\n", "takes no arguments"},
		{"static upstream", ":80 {\n\tsluice {\n\t\tto localhost:3000\n\t}\n}\n", "upstreams are the connected agents"},
		{"other transport", ":80 {\n\tsluice {\n\t\ttransport http {\n\t\t\tversions h2c\n\t\t}\n\t}\n}\n", "only `transport sluice"},
		{"unknown global", "{\n\tsluice {\n\t\tlisten_port 1\n\t}\n}\n:80\n", `unrecognized option "listen_port"`},
		{"listen arity", "{\n\tsluice {\n\t\tlisten a b\n\t}\n}\n:80\n", "listen: takes one value"},
		{"tls arity", "{\n\tsluice {\n\t\ttls cert.pem\n\t}\n}\n:80\n", "tls: want <cert_file> <key_file>"},
		{"bad duration", "{\n\tsluice {\n\t\tadvertise_timeout soon\n\t}\n}\n:80\n", "advertise_timeout"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(tc.in), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

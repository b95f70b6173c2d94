package caddymodule

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
)

// TestConfigRefusedAtLoad: settings that could only fail later (at an
// agent's connect or claim, or at every request) fail the load, naming the
// field.
func TestConfigRefusedAtLoad(t *testing.T) {
	t.Setenv("XDG_DATA_HOME", t.TempDir())
	t.Setenv("XDG_CONFIG_HOME", t.TempDir())
	const handler = `{"handler": "sluice"%s}`
	twoLines := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(twoLines, []byte("# the node's token\nload-test-token-0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, sluice, handler, want string
	}{
		{"listen without a port", `"listen": "127.0.0.1"`, "", `sluice: listen: "127.0.0.1" has no port`},
		{"tcp_bind that cannot bind", `"listen": "127.0.0.1:0", "tcp_port_range": "16000-16010", "tcp_bind": "192.0.2.77"`, "", `sluice: tcp_bind: "192.0.2.77"`},
		{"tcp_bind without tcp_port_range", `"listen": "127.0.0.1:0", "tcp_bind": "127.0.0.1"`, "", "sluice: tcp_bind: \"127.0.0.1\" without tcp_port_range"},
		{"dynamic upstreams not sluice", `"listen": "127.0.0.1:0"`, `, "dynamic_upstreams": {"source": "srv", "name": "x"}`, "sluice: dynamic_upstreams: must be `sluice`, got \"srv\""},
		{"active health checks", `"listen": "127.0.0.1:0"`, `, "health_checks": {"active": {"uri": "/health"}}`, "sluice: health_checks: active health checks"},
		{"a token no agent can send", `"listen": "127.0.0.1:0", "token": "s\u00e9cret-token-0123456789abcdef0123"`, "", "sluice: token: must be printable ASCII"},
		{"a token file of two lines", `"listen": "127.0.0.1:0", "token_file": "` + twoLines + `"`, "", "sluice: token_file: " + twoLines + ": must be printable ASCII"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			token := `, "token": "load-test-token-0123456789abcdef"`
			if strings.Contains(tc.sluice, `"token`) {
				token = ""
			}
			cfg := `{"admin": {"disabled": true}, "apps": {
				"sluice": {` + tc.sluice + token + `},
				"http": {"servers": {"s": {"listen": ["127.0.0.1:0"], "routes": [{"handle": [` +
				strings.Replace(handler, "%s", tc.handler, 1) + `]}]}}}}}`
			err := caddy.Load([]byte(cfg), true)
			if err == nil {
				caddy.Stop()
				t.Fatal("the config loaded")
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q, want it to contain %q", err, tc.want)
			}
		})
	}
}

package caddymodule

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

func TestDefaultKeepAliveKeepsWhatTheConfigSets(t *testing.T) {
	for _, tc := range []struct {
		name      string
		caddyfile string
		want      int
	}{
		{"nothing set", `sluice`, DefaultMaxIdleConnsPerRoute},
		{"other keep-alive options set", "sluice {\n\tkeepalive 90s\n}", DefaultMaxIdleConnsPerRoute},
		{"explicit", "sluice {\n\tkeepalive_idle_conns_per_host 4\n}", 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var tr Transport
			if err := tr.UnmarshalCaddyfile(caddyfile.NewTestDispenser(tc.caddyfile)); err != nil {
				t.Fatal(err)
			}
			idle := caddy.Duration(0)
			if tr.KeepAlive != nil {
				idle = tr.KeepAlive.IdleConnTimeout
			}
			defaultKeepAlive(&tr.HTTPTransport)
			if got := tr.KeepAlive.MaxIdleConnsPerHost; got != tc.want {
				t.Errorf("max_idle_conns_per_host = %d, want %d", got, tc.want)
			}
			if tr.KeepAlive.IdleConnTimeout != idle {
				t.Errorf("idle_timeout changed from %v to %v", idle, tr.KeepAlive.IdleConnTimeout)
			}
		})
	}
}

// TestTransportRefusesSocketOptions: options about dialing a socket would be
// silently ignored (the agent dials), so they fail the config with the
// option named; the other http transport options are accepted.
func TestTransportRefusesSocketOptions(t *testing.T) {
	for _, tc := range []struct {
		option, want string
	}{
		{"dial_timeout 5s", "dial_timeout"},
		{"dial_fallback_delay 300ms", "dial_fallback_delay"},
		{"local_address 127.0.0.1", "local_address"},
		{"resolvers 1.1.1.1", "resolvers"},
		{"keepalive_interval 10s", "keepalive_interval"},
		{"forward_proxy_url http://proxy.internal:3128", "forward_proxy_url"},
		{"network_proxy url http://proxy.internal:3128", "network_proxy/"},
		{"read_timeout 5s", "read_timeout/write_timeout"},
		{"write_timeout 5s", "read_timeout/write_timeout"},
		{"tls_except_ports 8443", "tls_except_ports"},
		{"response_header_timeout 5s", ""},
		{"keepalive 90s", ""},
		{"versions h2c", ""},
	} {
		t.Run(tc.option, func(t *testing.T) {
			var tr Transport
			if err := tr.UnmarshalCaddyfile(caddyfile.NewTestDispenser("sluice {\n\t" + tc.option + "\n}")); err != nil {
				t.Fatal(err)
			}
			err := refuseSocketOptions(&tr.HTTPTransport)
			switch {
			case tc.want == "" && err != nil:
				t.Fatalf("refused: %v", err)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want)):
				t.Fatalf("got %v, want an error naming %s", err, tc.want)
			}
		})
	}
}

package caddymodule

import (
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

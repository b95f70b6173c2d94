package caddymodule

import (
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	_ "github.com/caddyserver/caddy/v2/modules/caddytls"

	"github.com/sluice-tunnel/sluice/internal/adapttest"
)

// TestCaddyfileAdapt compares adapted testdata/adapt/*.caddytest files with
// their golden JSON (go test -update rewrites them).
func TestCaddyfileAdapt(t *testing.T) {
	adapttest.Run(t, "testdata/adapt/*.caddytest")
}

// TestCaddyfileErrors: invalid Caddyfiles fail at adapt time, naming what is wrong.
func TestCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"directive args", ":80 {\n\tsluice localhost:3000\n}\n", "takes no arguments"},
		{"static upstream", ":80 {\n\tsluice {\n\t\tto localhost:3000\n\t}\n}\n", "upstreams are the connected agents"},
		{"other transport", ":80 {\n\tsluice {\n\t\ttransport http {\n\t\t\tversions h2c\n\t\t}\n\t}\n}\n", "only `transport sluice"},
		{"unknown global", "{\n\tsluice {\n\t\tlisten_port 1\n\t}\n}\n:80\n", `unrecognized option "listen_port"`},
		{"listen arity", "{\n\tsluice {\n\t\tlisten a b\n\t}\n}\n:80\n", "listen: takes one value"},
		{"node_id arity", "{\n\tsluice {\n\t\tnode_id\n\t}\n}\n:80\n", "node_id: missing value"},
		{"tls arity", "{\n\tsluice {\n\t\ttls cert.pem\n\t}\n}\n:80\n", "tls: want <cert_file> <key_file>"},
		{"bad duration", "{\n\tsluice {\n\t\tadvertise_timeout soon\n\t}\n}\n:80\n", "advertise_timeout"},
		{"media types with a comma", ":80 {\n\tsluice {\n\t\tstream_request_accept_types text/event-stream,application/x-ndjson\n\t}\n}\n", "sluice: stream_request_accept_types: \"text/event-stream,application/x-ndjson\" is not a media type"},
		{"data_lane value", "{\n\tsluice {\n\t\tdata_lane maybe\n\t}\n}\n:80\n", `data_lane: want on or off, got "maybe"`},
		{"keep_forwarded_headers value", ":80 {\n\tsluice {\n\t\tkeep_forwarded_headers yes\n\t}\n}\n", `sluice: keep_forwarded_headers: takes no value, got "yes"`},
		{"direct_sockets value", "{\n\tsluice {\n\t\tdirect_sockets maybe\n\t}\n}\n:80\n", `direct_sockets: want on or off, got "maybe"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(tc.in), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

package caddymodule

import (
	"encoding/json"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
)

// TestCaddyfileErrorsHeadersAndPorts: forward_headers,
// response_header_timeout and the port lists fail at adapt time, naming the
// option and what is wrong.
func TestCaddyfileErrorsHeadersAndPorts(t *testing.T) {
	for _, tc := range []struct{ name, in, want string }{
		{"forward_headers bad name", ":80 {\n\tsluice {\n\t\tforward_headers Authorization \"X Bad\"\n\t}\n}\n", `sluice: forward_headers: "X Bad" is not a header name`},
		{"forward_headers pseudo-header", ":80 {\n\tsluice {\n\t\tforward_headers :authority\n\t}\n}\n", `sluice: forward_headers: ":authority" is not a header name`},
		{"response_header_timeout value", ":80 {\n\tsluice {\n\t\tresponse_header_timeout soon\n\t}\n}\n", `sluice: response_header_timeout: "soon" is not a duration (or off)`},
		{"response_header_timeout negative", ":80 {\n\tsluice {\n\t\tresponse_header_timeout -5s\n\t}\n}\n", `sluice: response_header_timeout: "-5s" is not a duration`},
		{"response_header_timeout arity", ":80 {\n\tsluice {\n\t\tresponse_header_timeout\n\t}\n}\n", "sluice: response_header_timeout: want one duration, or off"},
		{"tcp_port_range bad piece", "{\n\tsluice {\n\t\ttcp_port_range 16000-16099,abc\n\t}\n}\n:80\n", `sluice: tcp_port_range: "16000-16099,abc": piece "abc" is not a port`},
		{"tcp_port_range bad arg", "{\n\tsluice {\n\t\ttcp_port_range 16000-16099 99999\n\t}\n}\n:80\n", `sluice: tcp_port_range: "16000-16099,99999": piece "99999"`},
		{"tcp_port_range missing", "{\n\tsluice {\n\t\ttcp_port_range\n\t}\n}\n:80\n", "sluice: tcp_port_range: missing value"},
		{"credential ports bad arg", "{\n\tsluice {\n\t\tcredential ops {\n\t\t\ttoken 0123456789abcdef0123456789abcdef\n\t\t\tports 16000-16009 x\n\t\t}\n\t}\n}\n:80\n", `sluice: credential ops: ports: "16000-16009,x": piece "x"`},
		{"credential ports missing", "{\n\tsluice {\n\t\tcredential ops {\n\t\t\tports\n\t\t}\n\t}\n}\n:80\n", "sluice: credential ops: ports: missing value"},
		{"udp_port_range reversed", "{\n\tsluice {\n\t\tudp_port_range 15400 15309-15300\n\t}\n}\n:80\n", `sluice: udp_port_range: "15400,15309-15300": piece "15309-15300"`},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(tc.in), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

// TestResponseHeaderTimeoutFromAdaptedConfig reads the deadline before the
// response head off the adapted config: 60 s when the Caddyfile says
// nothing, the configured value otherwise, off for off.
func TestResponseHeaderTimeoutFromAdaptedConfig(t *testing.T) {
	for _, tc := range []struct {
		sub  string
		want time.Duration
	}{
		{"", 60 * time.Second},
		{"\t\tresponse_header_timeout 15s\n", 15 * time.Second},
		{"\t\tresponse_header_timeout off\n", 0},
		{"\t\tresponse_header_timeout 0\n", 0},
	} {
		in := "app.example.com {\n\tsluice {\n" + tc.sub + "\t}\n}\n"
		out, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
		if err != nil {
			t.Fatalf("%q: %v", tc.sub, err)
		}
		var h Handler
		if err := json.Unmarshal(sluiceHandlerJSON(t, out), &h); err != nil {
			t.Fatal(err)
		}
		if got := h.responseHeaderTimeout(); got != tc.want {
			t.Errorf("%q: response_header_timeout %v, want %v", tc.sub, got, tc.want)
		}
	}
}

// sluiceHandlerJSON finds the config of the first `sluice` handler in an
// adapted config.
func sluiceHandlerJSON(t *testing.T, cfg []byte) json.RawMessage {
	t.Helper()
	var walk func(v any) map[string]any
	walk = func(v any) map[string]any {
		switch v := v.(type) {
		case map[string]any:
			if v["handler"] == "sluice" {
				return v
			}
			for _, e := range v {
				if m := walk(e); m != nil {
					return m
				}
			}
		case []any:
			for _, e := range v {
				if m := walk(e); m != nil {
					return m
				}
			}
		}
		return nil
	}
	var root any
	if err := json.Unmarshal(cfg, &root); err != nil {
		t.Fatal(err)
	}
	m := walk(root)
	if m == nil {
		t.Fatalf("no sluice handler in %s", cfg)
	}
	b, err := json.Marshal(m)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

package l4module

import (
	"os"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	_ "github.com/caddyserver/caddy/v2/modules/caddyhttp"
	_ "github.com/caddyserver/caddy/v2/modules/caddytls"
	_ "github.com/mholt/caddy-l4/layer4"
	_ "github.com/mholt/caddy-l4/modules/l4proxyprotocol"
	_ "github.com/mholt/caddy-l4/modules/l4tls"

	_ "github.com/sluice-tunnel/sluice/caddymodule"

	"github.com/sluice-tunnel/sluice/internal/adapttest"
)

// TestCaddyfileAdapt compares adapted testdata/adapt/*.caddytest files with
// their golden JSON (go test -update rewrites them).
func TestCaddyfileAdapt(t *testing.T) {
	adapttest.Run(t, "testdata/adapt/*.caddytest")
}

func TestCaddyfileErrors(t *testing.T) {
	in := "{\n\tlayer4 {\n\t\t:5000 {\n\t\t\troute {\n\t\t\t\tsluice a b\n\t\t\t}\n\t\t}\n\t}\n}\n"
	_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
	if err == nil || !strings.Contains(err.Error(), "wrong argument count") {
		t.Fatalf("got %v", err)
	}
}

// TestCaddyfileExampleAdapts keeps the repository's Caddyfile.example valid.
func TestCaddyfileExampleAdapts(t *testing.T) {
	raw, err := os.ReadFile("../Caddyfile.example")
	if err != nil {
		t.Fatal(err)
	}
	out, warnings, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt(raw, map[string]any{"filename": "Caddyfile.example"})
	if err != nil {
		t.Fatalf("Caddyfile.example does not adapt: %v", err)
	}
	for _, w := range warnings {
		t.Errorf("Caddyfile.example warning: %s:%d: %s", w.File, w.Line, w.Message)
	}
	for _, want := range []string{`"sluice"`, `"layer4"`, `"tcp_port_range":"16000-16999,17000,17100-17199"`,
		`"lb_policy":"least_conn"`, `"response_header_timeout":30000000000`} {
		if !strings.Contains(string(out), want) {
			t.Errorf("adapted Caddyfile.example lacks %s", want)
		}
	}
}

package caddymodule

import (
	"context"
	"net/http/httptest"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"go.uber.org/zap"
)

// probe runs h for one request, with the replacer values vars (Caddy's
// server sets http.shutting_down), and returns the status and body.
func probe(t *testing.T, h *Health, vars map[string]any) (int, string) {
	t.Helper()
	repl := caddy.NewReplacer()
	for k, v := range vars {
		repl.Set(k, v)
	}
	req := httptest.NewRequest("GET", "/ready", nil)
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
	rec := httptest.NewRecorder()
	if err := h.ServeHTTP(rec, req, nil); err != nil {
		t.Fatal(err)
	}
	if ct := rec.Header().Get("Content-Type"); ct != "application/json" {
		t.Fatalf("Content-Type %q", ct)
	}
	return rec.Code, strings.TrimSpace(rec.Body.String())
}

func TestHealthHandlerReadiness(t *testing.T) {
	n := testNode(t)
	ready, live := &Health{Check: checkReady, node: n}, &Health{Check: checkLive, node: n}
	for _, tc := range []struct {
		name string
		h    *Health
		vars map[string]any
		code int
		body string
	}{
		{"ready", ready, nil, 200, `{"status":"ready"}`},
		{"live", live, nil, 200, `{"status":"live"}`},
		{"server shutting down", ready, map[string]any{"http.shutting_down": true}, 503, `{"status":"not_ready","reason":"server shutting down"}`},
	} {
		if code, body := probe(t, tc.h, tc.vars); code != tc.code || body != tc.body {
			t.Errorf("%s: %d %s, want %d %s", tc.name, code, body, tc.code, tc.body)
		}
	}
	n.drain()
	if code, body := probe(t, ready, nil); code != 503 || body != `{"status":"not_ready","reason":"draining"}` {
		t.Fatalf("ready while draining: %d %s", code, body)
	}
	if code, _ := probe(t, live, nil); code != 200 {
		t.Fatalf("live while draining: %d", code)
	}
}

// TestHealthNotReadyUntilServing: a node whose config has not started
// (its control listener not bound yet) is not ready.
func TestHealthNotReadyUntilServing(t *testing.T) {
	n := newNode("idle", nil, zap.NewNop())
	t.Cleanup(n.drainNow)
	code, body := probe(t, &Health{Check: checkReady, node: n}, nil)
	if code != 503 || !strings.Contains(body, "not serving yet") {
		t.Fatalf("%d %s", code, body)
	}
}

func TestHealthCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ in, want string }{
		{":80 {\n\tsluice_health maybe\n}\n", `sluice_health: want ready or live, got "maybe"`},
		{":80 {\n\tsluice_health ready live\n}\n", `sluice_health: takes one argument`},
		{":80 {\n\tsluice_health {\n\t\tcheck live\n\t}\n}\n", `sluice_health: takes no block`},
	} {
		_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(tc.in), nil)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%q: got %v, want an error containing %q", tc.in, err, tc.want)
		}
	}
	if err := (&Health{Check: "maybe"}).Validate(); err == nil || !strings.Contains(err.Error(), "sluice_health") {
		t.Fatalf("Validate: %v", err)
	}
}

package integration

import (
	"context"
	"io"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

// forwardHeadersSites: allow.test crosses only Authorization and X-Tenant
// (and what header_up adds), ws.test only Authorization, every other host
// every header.
const forwardHeadersSites = `http://allow.test:{HTTP} {
	sluice {
		forward_headers Authorization
		forward_headers x-tenant
		header_up X-Added edge
		header_up X-Copied {http.request.header.X-Secret}
	}
}

http://ws.test:{HTTP} {
	sluice {
		forward_headers Authorization
	}
}

http://:{HTTP} {
	sluice
}`

// forwardHeadersSent are what the client sends in the forward_headers tests.
func forwardHeadersSent() http.Header {
	return http.Header{
		"Authorization":     {"Bearer demo-token"},
		"X-Tenant":          {"acme"},
		"Cookie":            {"session=s3cret"},
		"X-Secret-Internal": {"must-not-cross"},
		"X-Secret":          {"copied-by-header-up"},
		"Forwarded":         {"for=1.2.3.4"},
		"User-Agent":        {"forward-headers-test"},
		"Content-Type":      {"application/json"},
	}
}

// postEchoed POSTs a JSON body with forwardHeadersSent to host and returns the
// headers the echo upstream saw, by lower-case name.
func postEchoed(t *testing.T, c *caddyServer, host string) map[string]string {
	t.Helper()
	req, _ := http.NewRequest("POST", c.url("/"), strings.NewReader(`{"item":"widget"}`))
	req.Host = host
	for k, v := range forwardHeadersSent() {
		req.Header[k] = v
	}
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatalf("POST %s: %v", host, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != 200 {
		t.Fatalf("%s: %d %q", host, resp.StatusCode, b)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(string(b)), "\n") {
		if k, v, ok := strings.Cut(line, ": "); ok {
			got[strings.ToLower(k)] = v
		}
	}
	return got
}

// TestForwardHeaders: with forward_headers only the listed request headers
// reach the upstream, with header_up's additions (which may copy a dropped
// header) and what HTTP needs (the body's Content-Type, reverse_proxy's
// X-Forwarded-*); without it every header crosses as before. A WebSocket
// keeps its handshake under the allow-list.
func TestForwardHeaders(t *testing.T) {
	c := startCaddy(t, forwardHeadersSites)
	echo := startHeaderEcho(t)
	app := serveUpstream(t, sampleupstream.Handler("ws"))
	startAgent(t, c.serverURL(), "agent-fh",
		agent.Upstream{Host: "allow.test", Target: echo},
		agent.Upstream{Host: "all.test", Target: echo},
		agent.Upstream{Host: "ws.test", Target: app})

	t.Run("allow-list", func(t *testing.T) {
		got := postEchoed(t, c, "allow.test")
		want := map[string]string{
			"authorization": "Bearer demo-token",
			"x-tenant":      "acme",
			"x-added":       "edge",
			"x-copied":      "copied-by-header-up",
			"content-type":  "application/json",
		}
		for k, v := range want {
			if got[k] != v {
				t.Errorf("%s = %q, want %q", k, got[k], v)
			}
		}
		for _, k := range []string{"cookie", "x-secret-internal", "x-secret", "forwarded", "user-agent"} {
			if v, ok := got[k]; ok {
				t.Errorf("%s crossed (%q); it is not listed", k, v)
			}
		}
		// Nothing else but what the edge itself sets.
		edge := []string{"x-forwarded-for", "x-forwarded-proto", "x-forwarded-host", "via", "content-length", "accept-encoding"}
		for k := range got {
			if _, ok := want[k]; !ok && !slices.Contains(edge, k) {
				t.Errorf("unexpected header %s: %q", k, got[k])
			}
		}
		if got["x-forwarded-for"] != "127.0.0.1" {
			t.Errorf("X-Forwarded-For = %q, want reverse_proxy's 127.0.0.1", got["x-forwarded-for"])
		}
	})

	t.Run("without forward_headers every header crosses", func(t *testing.T) {
		got := postEchoed(t, c, "all.test")
		for k, v := range forwardHeadersSent() {
			if k == "Forwarded" {
				continue // removed from a client that is not a trusted proxy (keep_forwarded_headers)
			}
			if got[strings.ToLower(k)] != v[0] {
				t.Errorf("%s = %q, want %q", k, got[strings.ToLower(k)], v[0])
			}
		}
	})

	t.Run("websocket under the allow-list", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		ws, _, err := websocket.Dial(ctx, strings.Replace(c.url("/ws"), "http", "ws", 1), &websocket.DialOptions{
			Host: "ws.test", HTTPHeader: http.Header{"X-Secret-Internal": {"no"}},
		})
		if err != nil {
			t.Fatalf("websocket dial through forward_headers: %v", err)
		}
		defer ws.CloseNow()
		echoWS(t, ws, 3)
	})
}

package integration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// spoofedForwarding is what a client sends to pass for 1.2.3.4 with an
// upstream that reads Forwarded or X-Real-IP.
func spoofedForwarding() http.Header {
	return http.Header{
		"Forwarded": {"for=1.2.3.4;proto=https"},
		"X-Real-Ip": {"1.2.3.4"},
		"X-Probe":   {"passes"},
	}
}

// forwardingNames are the header names (lower case, as echoed) that carry
// spoofedForwarding's client address.
var forwardingNames = []string{"forwarded", "x-real-ip"}

// siteStripAndKeep serves keep.test with keep_forwarded_headers and every
// other host with the defaults.
const siteStripAndKeep = `http://keep.test:{HTTP} {
	sluice {
		keep_forwarded_headers
	}
}

http://:{HTTP} {
	sluice
}`

// TestClientForwardingHeaders: Forwarded and X-Real-IP from a client that
// is not a trusted proxy never reach the upstream; keep_forwarded_headers
// passes them; header_up applies after the removal, so it can set
// X-Real-IP from the address Caddy trusts.
func TestClientForwardingHeaders(t *testing.T) {
	c := startCaddy(t, `http://realip.test:{HTTP} {
	sluice {
		header_up X-Real-IP {client_ip}
	}
}

`+siteStripAndKeep)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "strip.test", Target: echo},
		agent.Upstream{Host: "keep.test", Target: echo},
		agent.Upstream{Host: "realip.test", Target: echo})

	t.Run("removed from an untrusted client", func(t *testing.T) {
		got := echoedHeaders(t, c, "strip.test", spoofedForwarding())
		for _, name := range forwardingNames {
			if v, ok := got[name]; ok {
				t.Errorf("upstream saw %s: %q; want it removed", name, v)
			}
		}
		if got["x-probe"] != "passes" {
			t.Errorf("X-Probe = %q; other headers must pass", got["x-probe"])
		}
		if got["x-forwarded-for"] != "127.0.0.1" {
			t.Errorf("X-Forwarded-For = %q; want reverse_proxy's 127.0.0.1", got["x-forwarded-for"])
		}
	})
	t.Run("kept with keep_forwarded_headers", func(t *testing.T) {
		assertForwardingKept(t, echoedHeaders(t, c, "keep.test", spoofedForwarding()))
	})
	t.Run("header_up sets X-Real-IP from client_ip", func(t *testing.T) {
		got := echoedHeaders(t, c, "realip.test", spoofedForwarding())
		if got["x-real-ip"] != "127.0.0.1" || got["forwarded"] != "" {
			t.Errorf("upstream saw X-Real-IP %q, Forwarded %q; want 127.0.0.1 and none",
				got["x-real-ip"], got["forwarded"])
		}
	})
}

// TestClientForwardingHeadersUnderscoreSpelling: a server that lets
// X_Real_IP in (expected_underscore_headers) still does not pass it from an
// untrusted client: CGI-style upstreams read it as X-Real-IP.
func TestClientForwardingHeadersUnderscoreSpelling(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Global: "\tservers {\n\t\texpected_underscore_headers X_Real_IP\n\t}\n"}, siteStripAndKeep)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "strip.test", Target: echo},
		agent.Upstream{Host: "keep.test", Target: echo})
	hdr := http.Header{"X_Real_IP": {"1.2.3.4"}}
	if got := echoedHeaders(t, c, "keep.test", hdr); got["x_real_ip"] != "1.2.3.4" {
		t.Fatalf("keep.test: upstream saw X_Real_IP %q; want 1.2.3.4 (the server must let it in for this test)", got["x_real_ip"])
	}
	if got := echoedHeaders(t, c, "strip.test", hdr); got["x_real_ip"] != "" {
		t.Errorf("strip.test: upstream saw X_Real_IP %q; want it removed", got["x_real_ip"])
	}
}

// TestClientForwardingHeadersFromTrustedProxy: a request from one of the
// server's trusted_proxies, or of the directive's own, keeps Forwarded and
// X-Real-IP, as reverse_proxy keeps its X-Forwarded-*.
func TestClientForwardingHeadersFromTrustedProxy(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Global: "\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}\n"},
		`http://:{HTTP} {
	sluice
}`)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "strip.test", Target: echo})
	assertForwardingKept(t, echoedHeaders(t, c, "strip.test", spoofedForwarding()))
}

// TestClientForwardingHeadersDirectiveTrustedProxies: the directive's own
// trusted_proxies (reverse_proxy's) count too.
func TestClientForwardingHeadersDirectiveTrustedProxies(t *testing.T) {
	c := startCaddy(t, `http://:{HTTP} {
	sluice {
		trusted_proxies 127.0.0.1
	}
}`)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "strip.test", Target: echo})
	assertForwardingKept(t, echoedHeaders(t, c, "strip.test", spoofedForwarding()))
}

// TestClientForwardingBadTrustedProxiesFailsLoad: a directive
// trusted_proxies entry that is no address fails the load, naming the field,
// and the running config stays.
func TestClientForwardingBadTrustedProxiesFailsLoad(t *testing.T) {
	c := startCaddy(t, siteAll)
	bad := "http://:{HTTP} {\n\tsluice {\n\t\ttrusted_proxies 10.0.0.300\n\t}\n}"
	cfgJSON, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(c.caddyfile(bad)), nil)
	if err != nil {
		t.Fatalf("adapt: %v", err)
	}
	err = caddy.Load(cfgJSON, true)
	if err == nil || !strings.Contains(err.Error(), "sluice: trusted_proxies") {
		t.Fatalf("load: %v; want an error naming sluice: trusted_proxies", err)
	}
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from app") {
		t.Fatalf("after the refused load: %d %q; want the old config serving", code, body)
	}
}

// TestClientAddrIgnoresSpoofedXFF: without trusted_proxies, a client on
// 127.0.0.1 that writes X-Forwarded-For: 10.0.0.1 is judged as 127.0.0.1.
func TestClientAddrIgnoresSpoofedXFF(t *testing.T) {
	c := startCaddy(t, siteAll)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "loopback.test", Target: echo, AllowedCIDRs: []string{"127.0.0.0/8"}},
		agent.Upstream{Host: "ten.test", Target: echo, AllowedCIDRs: []string{"10.0.0.0/8"}})
	xff := http.Header{"X-Forwarded-For": {"10.0.0.1"}}
	if code, body := getHeaders(t, c, "loopback.test", xff); code != 200 {
		t.Errorf("loopback.test with X-Forwarded-For 10.0.0.1: %d %q; want 200 (judged as 127.0.0.1)", code, body)
	}
	if code, body := getHeaders(t, c, "ten.test", xff); code != 403 {
		t.Errorf("ten.test with X-Forwarded-For 10.0.0.1: %d %q; want 403 (judged as 127.0.0.1)", code, body)
	}
}

// TestClientAddrStrictTrustedProxy: behind a trusted proxy (127.0.0.1)
// with trusted_proxies_strict, allowed_cidrs judge the rightmost
// X-Forwarded-For hop that is not a trusted proxy, and nothing warns.
func TestClientAddrStrictTrustedProxy(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{
		Global:     "\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t\ttrusted_proxies_strict\n\t}\n",
		CaptureLog: true,
	}, siteAll)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "inner.test", Target: echo, AllowedCIDRs: []string{"192.0.2.0/24"}})
	for _, tc := range []struct {
		xff  string
		want int
	}{
		{"192.0.2.7", 200},
		{"192.0.2.7, 10.0.0.1", 403},  // the leftmost would pass
		{"10.0.0.1, 192.0.2.7", 200},  // the leftmost would fail
		{"192.0.2.7, 127.0.0.1", 200}, // a trusted hop is skipped
		{"", 403},                     // the proxy itself
	} {
		hdr := http.Header{}
		if tc.xff != "" {
			hdr.Set("X-Forwarded-For", tc.xff)
		}
		if code, body := getHeaders(t, c, "inner.test", hdr); code != tc.want {
			t.Errorf("X-Forwarded-For %q: %d %q; want %d", tc.xff, code, body, tc.want)
		}
	}
	if lines := c.logLines(t, laxClientIPMsg); len(lines) != 0 {
		t.Errorf("strict server logged %q: %s", laxClientIPMsg, lines[0])
	}
}

// laxClientIPMsg is the node's warning when it judges allowed_cidrs behind
// a trusted proxy without trusted_proxies_strict.
const laxClientIPMsg = "allowed_cidrs judged behind a trusted proxy without trusted_proxies_strict"

// TestClientAddrLaxTrustedProxy pins the documented choice without
// trusted_proxies_strict: allowed_cidrs follow Caddy's client_ip, the
// leftmost X-Forwarded-For entry, and the node warns once that a client can
// write it.
func TestClientAddrLaxTrustedProxy(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{
		Global:     "\tservers {\n\t\ttrusted_proxies static 127.0.0.1/32\n\t}\n",
		CaptureLog: true,
	}, siteAll)
	echo := startHeaderEcho(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "inner.test", Target: echo, AllowedCIDRs: []string{"192.0.2.0/24"}})
	xff := http.Header{"X-Forwarded-For": {"192.0.2.7, 10.0.0.1"}}
	for i := range 2 {
		if code, body := getHeaders(t, c, "inner.test", xff); code != 200 {
			t.Fatalf("request %d: %d %q; want 200 (judged on the leftmost, 192.0.2.7)", i, code, body)
		}
	}
	testwait.Until(t, 5*time.Second, "the trusted_proxies_strict warning", func() bool {
		return len(c.logLines(t, laxClientIPMsg)) > 0
	})
	if lines := c.logLines(t, laxClientIPMsg); len(lines) != 1 {
		t.Errorf("logged the warning %d times; want once", len(lines))
	}
}

// assertForwardingKept checks that spoofedForwarding's headers all reached
// the upstream unchanged.
func assertForwardingKept(t *testing.T, got map[string]string) {
	t.Helper()
	want := spoofedForwarding()
	for _, name := range forwardingNames {
		var sent string
		for k, v := range want {
			if strings.EqualFold(k, name) {
				sent = v[0]
			}
		}
		if got[name] != sent {
			t.Errorf("upstream saw %s: %q; want %q kept", name, got[name], sent)
		}
	}
}

// startHeaderEcho runs an upstream that answers every request with its
// request headers, one "Name: value" line each, sorted.
func startHeaderEcho(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{ReadHeaderTimeout: 10 * time.Second, Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		names := make([]string, 0, len(r.Header))
		for k := range r.Header {
			names = append(names, k)
		}
		slices.Sort(names)
		for _, k := range names {
			fmt.Fprintf(w, "%s: %s\n", k, strings.Join(r.Header[k], ", "))
		}
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// echoedHeaders sends a request with hdr to host and returns the headers
// the echo upstream saw, by lower-case name.
func echoedHeaders(t *testing.T, c *caddyServer, host string, hdr http.Header) map[string]string {
	t.Helper()
	code, body := getHeaders(t, c, host, hdr)
	if code != 200 {
		t.Fatalf("%s: %d %q", host, code, body)
	}
	got := map[string]string{}
	for _, line := range strings.Split(strings.TrimSpace(body), "\n") {
		if k, v, ok := strings.Cut(line, ": "); ok {
			got[strings.ToLower(k)] = v
		}
	}
	return got
}

// getHeaders is get with request headers, sent with their keys as written.
func getHeaders(t testing.TB, c *caddyServer, host string, hdr http.Header) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url("/"), nil)
	req.Host = host
	for k, v := range hdr {
		req.Header[k] = v
	}
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", host, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

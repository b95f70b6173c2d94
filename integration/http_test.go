package integration

import (
	"bufio"
	"context"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"net/http/httptrace"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

// startUpstream serves the sample application on loopback.
func startUpstream(t testing.TB, name string) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := sampleupstream.Server(sampleupstream.Handler(name))
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// siteAll proxies every host on the plain HTTP port, with h2c allowed.
const siteAll = `http://:{HTTP} {
	sluice
}`

func TestHTTPRequestsThroughTunnel(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})

	t.Run("curl GET keeps Host and sets X-Forwarded", func(t *testing.T) {
		curl := needCommand(t, "curl")
		out, err := exec.Command(curl, "-sS", "--max-time", "20", "-H", "Host: app.test", c.url("/headers")).CombinedOutput()
		if err != nil {
			t.Fatalf("curl: %v: %s", err, out)
		}
		s := string(out)
		if !strings.Contains(s, "Host: app.test") || !strings.Contains(s, "X-Forwarded-For: 127.0.0.1") || !strings.Contains(s, "X-Forwarded-Proto: http") {
			t.Fatalf("upstream saw:\n%s", s)
		}
	})

	t.Run("POST 50 MiB streamed, checksum intact", func(t *testing.T) {
		const size = 50 << 20
		h := sha256.New()
		io.Copy(h, sampleupstream.Pattern(size))
		want := fmt.Sprintf("%d %s\n", size, hex.EncodeToString(h.Sum(nil)))
		req, _ := http.NewRequest("POST", c.url("/upload"), sampleupstream.Pattern(size))
		req.Host = "app.test"
		req.ContentLength = -1 // chunked upload
		resp, err := hostClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		got, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || string(got) != want {
			t.Fatalf("status %d, body %q, want %q", resp.StatusCode, got, want)
		}
	})

	t.Run("200 MiB download, checksum intact", func(t *testing.T) {
		const size = 200 << 20
		checkDownload(t, c, "app.test", size)
	})

	t.Run("HTTP/1.1 keep-alive reuses one client connection", func(t *testing.T) {
		client := &http.Client{Transport: &http.Transport{MaxConnsPerHost: 1}}
		reused := 0
		for i := 0; i < 5; i++ {
			req, _ := http.NewRequest("GET", c.url("/"), nil)
			req.Host = "app.test"
			trace := &httptrace.ClientTrace{GotConn: func(info httptrace.GotConnInfo) {
				if info.Reused {
					reused++
				}
			}}
			req = req.WithContext(httptrace.WithClientTrace(req.Context(), trace))
			resp, err := client.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if resp.StatusCode != 200 {
				t.Fatalf("status %d", resp.StatusCode)
			}
		}
		if reused != 4 {
			t.Fatalf("reused the connection %d times of 4", reused)
		}
	})

	t.Run("h2c prior knowledge at Caddy", func(t *testing.T) {
		client := h2cClient()
		req, _ := http.NewRequest("GET", c.url("/"), nil)
		req.Host = "app.test"
		resp, err := client.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.ProtoMajor != 2 || !strings.Contains(string(b), "Hello from app") {
			t.Fatalf("proto %s, body %q", resp.Proto, b)
		}
	})
}

func checkDownload(t testing.TB, c *caddyServer, host string, size int64) {
	t.Helper()
	if err := downloadOK(c, host, size); err != nil {
		t.Fatal(err)
	}
}

func TestHTTPSH2AtCaddy(t *testing.T) {
	curl := needCommand(t, "curl")
	c := startCaddy(t, `app.test {
	tls internal
	sluice
}`)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	url := fmt.Sprintf("https://app.test:%d/", c.httpsPort)
	resolve := fmt.Sprintf("app.test:%d:127.0.0.1", c.httpsPort)
	var out []byte
	// The internal certificate is issued just after start: retry briefly.
	eventually(t, 15*time.Second, "HTTPS answer", func() bool {
		var err error
		out, err = exec.Command(curl, "-sSk", "--http2", "--max-time", "5", "--resolve", resolve, "-w", "\nversion=%{http_version}", url).CombinedOutput()
		return err == nil
	})
	s := string(out)
	if !strings.Contains(s, "Hello from app: host=app.test") || !strings.Contains(s, "version=2") {
		t.Fatalf("curl over h2:\n%s", s)
	}
}

// TestServerNameThatIsNotUTF8: a TLS client's server name is any bytes, and
// one that is not UTF-8 still gets a wildcard certificate. The node passes
// it on in the Connect frame made valid (protobuf refuses to marshal a
// string that is not UTF-8, and the failed frame used to end the agent's
// whole session, again on every retry).
func TestServerNameThatIsNotUTF8(t *testing.T) {
	c := startCaddy(t, `*.odd.test {
	tls internal
	sluice
}`)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-odd", agent.Upstream{Host: "a.odd.test", Target: up})
	get := func(serverName string) (string, error) {
		tr := &http.Transport{TLSClientConfig: insecureTLS(serverName)}
		defer tr.CloseIdleConnections()
		req, err := http.NewRequest(http.MethodGet, fmt.Sprintf("https://127.0.0.1:%d/", c.httpsPort), nil)
		if err != nil {
			return "", err
		}
		req.Host = "a.odd.test"
		resp, err := (&http.Client{Transport: tr, Timeout: 10 * time.Second}).Do(req)
		if err != nil {
			return "", err
		}
		defer resp.Body.Close()
		b, err := io.ReadAll(resp.Body)
		return fmt.Sprintf("%d %s", resp.StatusCode, b), err
	}
	// The internal certificate is issued just after start: retry briefly.
	// The first request dials the agent with the odd name.
	var body string
	eventually(t, 15*time.Second, "HTTPS answer", func() bool {
		var err error
		body, err = get("\xff.odd.test")
		return err == nil && strings.HasPrefix(body, "200 Hello from app")
	})
	for range 3 {
		body, err := get("\xff.odd.test")
		if err != nil || !strings.HasPrefix(body, "200 Hello from app") {
			t.Fatalf("with the server name \\xff.odd.test: %q %v", body, err)
		}
	}
	if body, err := get("a.odd.test"); err != nil || !strings.HasPrefix(body, "200 Hello from app") {
		t.Fatalf("after the odd server names: %q %v", body, err)
	}
}

// TestForceHTTP1Route: with versions h2c on the sluice transport, a route
// whose agent upstream sets force_http1 still gets HTTP/1.1 (its upstream
// speaks nothing else), while another route of the same site gets h2c.
func TestForceHTTP1Route(t *testing.T) {
	c := startCaddy(t, `http://:{HTTP} {
	sluice {
		transport sluice {
			versions h2c
		}
	}
}`)
	// httptest's server speaks HTTP/1.1 only: an h2c preface fails there.
	h1 := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "h1-only upstream: proto=%s", r.Proto)
	}))
	t.Cleanup(h1.Close)
	both := startUpstream(t, "both")
	startAgent(t, c.serverURL(), "agent-h1",
		agent.Upstream{Host: "old.test", Target: h1.URL, ForceHTTP1: true},
		agent.Upstream{Host: "new.test", Target: both})
	for range 3 { // pooled connections keep their protocol too
		if code, body := get(t, c, "old.test", "/"); code != 200 || body != "h1-only upstream: proto=HTTP/1.1" {
			t.Fatalf("force_http1 route: %d %q", code, body)
		}
		if code, body := get(t, c, "new.test", "/"); code != 200 || !strings.Contains(body, "proto=HTTP/2.0") {
			t.Fatalf("h2c route: %d %q", code, body)
		}
	}
}

func TestHostRoutingAndUnknownHost(t *testing.T) {
	c := startCaddy(t, siteAll)
	upA, upB, upW, upC := startUpstream(t, "A"), startUpstream(t, "B"), startUpstream(t, "wild"), startUpstream(t, "catchall")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "a.test", Target: upA})
	// A raw TCP route with a name and no host is reached by its name
	// (layer4 `sluice raw`), never as the HTTP catch-all.
	startAgent(t, c.serverURL(), "agent-b", agent.Upstream{Host: "b.test", Target: upB},
		agent.Upstream{HostPattern: `[a-z]+\.wild\.test`, Target: upW},
		agent.Upstream{Name: "raw", Target: "tcp://127.0.0.1:9"})
	for _, tc := range []struct{ host, want string }{
		{"a.test", "Hello from A"},
		{"b.test", "Hello from B"},
		{"x.wild.test", "Hello from wild"},
		{"A.TEST:8080", "Hello from A"},
	} {
		if code, body := get(t, c, tc.host, "/"); code != 200 || !strings.Contains(body, tc.want) {
			t.Errorf("%s: %d %q, want %q", tc.host, code, body, tc.want)
		}
	}
	// A pattern matches the whole host only.
	code, body := get(t, c, "x.wild.test.evil", "/")
	if code != 503 || !strings.Contains(body, "no sluice agent is connected for x.wild.test.evil") {
		t.Fatalf("unknown host: %d %q", code, body)
	}
	// The catch-all route takes what no other route serves.
	startAgent(t, c.serverURL(), "agent-c", agent.Upstream{Host: "*", Target: upC})
	if code, body := get(t, c, "anything.test", "/"); code != 200 || !strings.Contains(body, "Hello from catchall") {
		t.Fatalf("catch-all: %d %q", code, body)
	}
	if _, body := get(t, c, "a.test", "/"); !strings.Contains(body, "Hello from A") {
		t.Fatalf("exact route must win over catch-all: %q", body)
	}
}

func TestWebSocketAndSSE(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})

	t.Run("WebSocket echo of 1000 messages", func(t *testing.T) {
		ws := dialWS(t, c, "app.test")
		defer ws.CloseNow()
		echoWS(t, ws, 1000)
		ws.Close(websocket.StatusNormalClosure, "")
	})
	t.Run("SSE events arrive one by one", func(t *testing.T) {
		req, _ := http.NewRequest("GET", c.url("/sse?n=5&every=300ms"), nil)
		req.Host = "app.test"
		req.Header.Set("Accept", "text/event-stream")
		start := time.Now()
		resp, err := hostClient().Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
			t.Fatalf("Content-Type %q", ct)
		}
		r := bufio.NewReader(resp.Body)
		var arrivals []time.Duration
		for len(arrivals) < 5 {
			line, err := r.ReadString('\n')
			if err != nil {
				t.Fatalf("after %d events: %v", len(arrivals), err)
			}
			if strings.HasPrefix(line, "data: ") {
				arrivals = append(arrivals, time.Since(start))
			}
		}
		// The upstream needs 1.2 s for all five: the first must arrive well
		// before the last was written, or the stream was buffered.
		if arrivals[0] >= arrivals[4]-600*time.Millisecond {
			t.Fatalf("events were coalesced: arrivals %v", arrivals)
		}
	})
}

func dialWS(t testing.TB, c *caddyServer, host string) *websocket.Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ws, _, err := websocket.Dial(ctx, strings.Replace(c.url("/ws"), "http", "ws", 1), &websocket.DialOptions{Host: host})
	if err != nil {
		t.Fatalf("websocket dial: %v", err)
	}
	return ws
}

func echoWS(t testing.TB, ws *websocket.Conn, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for i := 0; i < n; i++ {
		msg := fmt.Sprintf("message %d", i)
		if err := ws.Write(ctx, websocket.MessageText, []byte(msg)); err != nil {
			t.Fatalf("write %d: %v", i, err)
		}
		_, got, err := ws.Read(ctx)
		if err != nil || string(got) != msg {
			t.Fatalf("read %d: %q, %v", i, got, err)
		}
	}
}

// TestIdleVirtualConnectionsAreReused: the sluice transport keeps more idle
// upstream connections per route than Caddy's 32, so a second wave of 64
// concurrent requests reuses the virtual connections of the first instead
// of opening new ones (each a Connect through the tunnel and a TCP dial by
// the agent, which the upstream counts).
func TestIdleVirtualConnectionsAreReused(t *testing.T) {
	_, wave := pooledHoldSite(t, 64)
	// With Caddy's default of 32 idle connections per host the second wave
	// would open at least 32 new ones.
	if n := wave(); n >= 32 {
		t.Fatalf("second wave opened %d upstream connections: the idle ones were not kept", n)
	}
}

// pooledHoldSite starts Caddy, an upstream that holds requests and counts
// its connections, and agent-a serving hold.test; then it runs a first
// wave of n concurrent requests, held at the upstream until all arrived (so
// they need n upstream connections at once), and checks it opened n. wave
// runs another such wave and returns how many upstream connections it
// opened.
func pooledHoldSite(t *testing.T, n int) (c *caddyServer, wave func() int64) {
	t.Helper()
	c = startCaddy(t, siteAll)
	up := startLimHoldUpstream(t)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "hold.test", Target: up.url})
	cl := limClient()
	t.Cleanup(cl.CloseIdleConnections)
	wave = func() int64 {
		t.Helper()
		before := up.opened.Load()
		out := limFill(t, c, cl, up, "hold.test", n)
		up.release()
		limCollect(t, out, n, http.StatusOK)
		return up.opened.Load() - before
	}
	if opened := wave(); opened != int64(n) {
		t.Fatalf("first wave opened %d upstream connections, want %d", opened, n)
	}
	return c, wave
}

// TestAnotherAgentLeavingKeepsThePool: an agent's session ending drops
// only its own pooled connections (they fail with it); another agent's
// idle ones stay in use.
func TestAnotherAgentLeavingKeepsThePool(t *testing.T) {
	c, wave := pooledHoldSite(t, 16)
	up := startUpstream(t, "other")
	other := startAgent(t, c.serverURL(), "agent-b", agent.Upstream{Host: "other.test", Target: up})
	other.stop()
	eventually(t, 5*time.Second, "agent-b's session gone", func() bool { return c.mustStats(t).Sessions == 1 })
	if n := wave(); n != 0 {
		t.Fatalf("after another agent left, the wave opened %d upstream connections: the pool was dropped", n)
	}
}

// tlsSites: TLS from Caddy to the upstream through the agent's tcp:// route,
// with the default server name, a placeholder, a fixed name, and HTTP/1.1
// only.
const tlsSites = `http://default.test:{HTTP} {
	sluice {
		transport sluice {
			tls_insecure_skip_verify
		}
	}
}

http://placeholder.test:{HTTP} {
	sluice {
		transport sluice {
			tls_insecure_skip_verify
			tls_server_name {http.request.host}.internal
		}
	}
}

http://fixed.test:{HTTP} {
	sluice {
		transport sluice {
			tls_insecure_skip_verify
			tls_server_name upstream.internal
			versions 1.1
		}
	}
}`

// TestTLSToTheUpstreamThroughTheAgent: with `transport sluice { tls… }` the
// upstream sees the client's Host (not the dial address, which names an
// agent session), the server name is tls_server_name with placeholders
// replaced or else the request's host, and HTTP/2 is negotiated over TLS
// unless versions say otherwise.
func TestTLSToTheUpstreamThroughTheAgent(t *testing.T) {
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s|%s|%s", r.Host, r.TLS.ServerName, r.Proto)
	}))
	up.EnableHTTP2 = true
	up.StartTLS()
	t.Cleanup(up.Close)
	c := startCaddyWith(t, caddyOptions{NoRedirects: true}, tlsSites)
	startAgent(t, c.serverURL(), "agent-tls", agent.Upstream{Host: "*", Target: "tcp://" + up.Listener.Addr().String()})

	for _, tc := range []struct{ host, want string }{
		{"default.test", "default.test|default.test|HTTP/2.0"},
		{"placeholder.test", "placeholder.test|placeholder.test.internal|HTTP/2.0"},
		{"fixed.test", "fixed.test|upstream.internal|HTTP/1.1"},
	} {
		code, body := get(t, c, tc.host, "/")
		if code != 200 || body != tc.want {
			t.Errorf("%s: %d %q, want 200 %q (Host|server name|protocol at the upstream)", tc.host, code, body, tc.want)
		}
	}
}

// TestInvalidHostNeverReachesTheCatchAll: a Host that resembles a served
// name but is not a valid host (a second port, an empty label,
// percent-encoding) gets 400 instead of falling through to the catch-all
// agent, whose upstream might read it as the host it resembles.
func TestInvalidHostNeverReachesTheCatchAll(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "catch-all")
	startAgent(t, c.serverURL(), "agent-any", agent.Upstream{Host: "*", Target: up})
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "catch-all") {
		t.Fatalf("valid host: %d %q", code, body)
	}
	for _, host := range []string{"admin.example.com..", "admin.example.com:80:80", "admin%2eexample.com"} {
		conn, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", c.httpPort), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintf(conn, "GET / HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", host)
		resp, err := http.ReadResponse(bufio.NewReader(conn), nil)
		if err != nil {
			conn.Close()
			t.Fatalf("Host %q: %v", host, err)
		}
		body, _ := io.ReadAll(resp.Body)
		conn.Close()
		if resp.StatusCode != http.StatusBadRequest || !strings.Contains(string(body), "not a valid host") {
			t.Errorf("Host %q: %d %q, want 400 and not the catch-all's page", host, resp.StatusCode, body)
		}
	}
}

// TestHTTPSTargetBehindAnH2CTransport: an agent's https:// target speaks
// HTTP/1.1 inside its TLS session (the agent offers ALPN http/1.1 only), so
// its route is advertised force_http1 and a site whose transport speaks h2c
// to the agents still reaches it, over HTTP/1.1.
func TestHTTPSTargetBehindAnH2CTransport(t *testing.T) {
	up := httptest.NewUnstartedServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s over %s", r.Host, r.Proto)
	}))
	up.EnableHTTP2 = true
	up.StartTLS()
	t.Cleanup(up.Close)
	c := startCaddyWith(t, caddyOptions{NoRedirects: true}, grpcSite)
	startAgent(t, c.serverURL(), "agent-https", agent.Upstream{Host: "app.test", Target: up.URL, InsecureSkipVerify: true})
	if code, body := get(t, c, "app.test", "/"); code != 200 || body != "app.test over HTTP/1.1" {
		t.Fatalf("https target behind versions h2c: %d %q, want 200 \"app.test over HTTP/1.1\"", code, body)
	}
}

// TestTCPRouteTakesForceHTTP1: a tcp:// route reached by host, whose
// upstream speaks HTTP/1.1 only, is spoken to over HTTP/1.1 with
// force_http1 even where the site's transport speaks h2c, and its Host is
// rewritten with rewrite_host.
func TestTCPRouteTakesForceHTTP1(t *testing.T) {
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "%s over %s", r.Host, r.Proto)
	}))
	t.Cleanup(up.Close)
	c := startCaddyWith(t, caddyOptions{NoRedirects: true}, grpcSite)
	startAgent(t, c.serverURL(), "agent-tcp-h1", agent.Upstream{
		Host: "app.test", Target: "tcp://" + up.Listener.Addr().String(), ForceHTTP1: true, RewriteHost: "legacy.internal",
	})
	if code, body := get(t, c, "app.test", "/"); code != 200 || body != "legacy.internal over HTTP/1.1" {
		t.Fatalf("got %d %q, want 200 from the HTTP/1.1 upstream with the rewritten host", code, body)
	}
}

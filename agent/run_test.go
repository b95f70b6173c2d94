package agent

import (
	"bufio"
	"bytes"
	"context"
	"crypto/tls"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/credentials"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// httpGet sends a raw HTTP/1.1 GET over c and returns the response.
func httpGet(t testing.TB, c net.Conn, host, path string) (*http.Response, string) {
	t.Helper()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := fmt.Fprintf(c, "GET %s HTTP/1.1\r\nHost: %s\r\nConnection: close\r\n\r\n", path, host); err != nil {
		t.Fatalf("write request: %v", err)
	}
	resp, err := http.ReadResponse(bufio.NewReader(c), nil)
	if err != nil {
		t.Fatalf("read response: %v", err)
	}
	body, err := io.ReadAll(resp.Body)
	resp.Body.Close()
	if err != nil {
		t.Fatalf("read body: %v", err)
	}
	return resp, string(body)
}

func helloServer(t testing.TB, tlsServer bool) *httptest.Server {
	h := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello %s %s", r.Host, r.URL.Path)
	})
	s := httptest.NewUnstartedServer(h)
	s.Config.ErrorLog = log.New(io.Discard, "", 0) // expected handshake failures
	if tlsServer {
		s.StartTLS()
	} else {
		s.Start()
	}
	t.Cleanup(s.Close)
	return s
}

func TestAdvertiseAndHTTP(t *testing.T) {
	up := helloServer(t, false)
	node := newFakeNode(t, "secret", nodeOptions{})
	cfg := testConfig(node.addr, "secret",
		Upstream{Name: "web", Host: "App.Test", Target: up.URL, RewriteHost: "app.local", ForceHTTP1: true,
			AllowedCIDRs: []string{"10.0.0.0/8"}},
		Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:6379", VerbatimIdleTimeout: 90 * time.Second},
	)
	ag := startAgent(t, cfg)
	ns := node.next(t)

	// The handshake as the node sees it.
	if got := ns.md.Get("x-sluice-id"); len(got) != 1 || got[0] != "agent-test" {
		t.Errorf("x-sluice-id = %q", got)
	}
	adv := ns.adv
	if adv.GetAgentId() != "agent-test" || !strings.HasPrefix(adv.GetBuild(), "sluice-agent ") ||
		adv.GetInitialWindow() != tunnelcore.InitialWindow || len(adv.GetRoutes()) != 2 {
		t.Fatalf("advertise = %v", adv)
	}
	r0, r1 := adv.GetRoutes()[0], adv.GetRoutes()[1]
	if r0.GetName() != "web" || r0.GetHost() != "app.test" || r0.GetTarget() != up.URL ||
		r0.GetRewriteHost() != "app.local" || !r0.GetForceHttp1() || len(r0.GetAllowedCidrs()) != 1 {
		t.Errorf("route 0 = %v", r0)
	}
	if r1.GetName() != ":16379" || r1.GetListenPort() != 16379 || r1.GetVerbatimIdleTimeoutMs() != 90000 {
		t.Errorf("route 1 = %v", r1)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ag.WaitConnected(ctx); err != nil {
		t.Fatal(err)
	}
	if ag.State() != StateConnected || ag.NodeID() != "node-1" {
		t.Errorf("state %v node %q", ag.State(), ag.NodeID())
	}
	if !hasLog(ag.logs, "connected", "node_id", "node-1") {
		t.Error("no connected log line")
	}

	for i := 0; i < 3; i++ {
		c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "web", RemoteAddr: "203.0.113.7:5555"})
		if err != nil {
			t.Fatal(err)
		}
		resp, body := httpGet(t, c, "app.test", fmt.Sprintf("/hello/%d", i))
		c.Close()
		if resp.StatusCode != 200 || body != fmt.Sprintf("hello app.test /hello/%d", i) {
			t.Fatalf("response %d %q", resp.StatusCode, body)
		}
	}
}

// advertiseRoutes returns the routes advertise sends for ups.
func advertiseRoutes(t *testing.T, ups ...Upstream) map[string]*tunnelpb.Route {
	t.Helper()
	a, err := New(testConfig("127.0.0.1:1", "secret", ups...), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	routes := map[string]*tunnelpb.Route{}
	for _, r := range a.advertise().GetAdvertise().GetRoutes() {
		routes[r.GetName()] = r
	}
	if len(routes) != len(ups) {
		t.Fatalf("advertised %v", routes)
	}
	return routes
}

// The connector negotiates only http/1.1 with https targets, so a node
// whose transport enables h2c must use HTTP/1.1 for them.
func TestAdvertiseHTTPSForcesHTTP1(t *testing.T) {
	routes := advertiseRoutes(t,
		Upstream{Name: "tls", Host: "tls.test", Target: "https://127.0.0.1:8443"},
		Upstream{Name: "TLS-upper", Host: "tls2.test", Target: "HTTPS://127.0.0.1:8443"},
		Upstream{Name: "plain", Host: "plain.test", Target: "http://127.0.0.1:8080"},
		Upstream{Name: "plain-h1", Host: "h1.test", Target: "http://127.0.0.1:8080", ForceHTTP1: true},
		Upstream{Name: "raw", ListenPort: 2222, Target: "tcp://127.0.0.1:22"},
	)
	for name, want := range map[string]bool{"tls": true, "TLS-upper": true, "plain": false, "plain-h1": true, "raw": false} {
		if got := routes[name].GetForceHttp1(); got != want {
			t.Errorf("route %s: force_http1 = %v, want %v", name, got, want)
		}
	}
}

// The node reads the advertised values without the agent's normalisation
// (a "TCP://" target would not be recognised as verbatim).
func TestAdvertiseNormalisedValues(t *testing.T) {
	routes := advertiseRoutes(t,
		Upstream{Name: "db", Host: "DB.example.com", Target: "TCP://127.0.0.1:5432/", TLSPassthrough: true},
		Upstream{Name: "v6", Host: "[::1]", Target: "http://127.0.0.1:3000"},
		Upstream{Name: "redis", ListenPort: 16379, Target: "tcp://127.0.0.1:6379", VerbatimIdleTimeout: 1500 * time.Microsecond,
			AllowedCIDRs: []string{" 10.0.0.0/8", "2001:DB8::/32"}},
	)
	if r := routes["db"]; r.GetTarget() != "tcp://127.0.0.1:5432" || r.GetHost() != "db.example.com" {
		t.Errorf("db = %v", r)
	}
	if r := routes["v6"]; r.GetHost() != "::1" {
		t.Errorf("v6 = %v", r)
	}
	r := routes["redis"]
	if got := r.GetAllowedCidrs(); len(got) != 2 || got[0] != "10.0.0.0/8" || got[1] != "2001:db8::/32" {
		t.Errorf("allowed_cidrs %q", got)
	}
	if r.GetVerbatimIdleTimeoutMs() != 1 {
		t.Errorf("verbatim_idle_timeout_ms %d", r.GetVerbatimIdleTimeoutMs())
	}
}

func TestUnknownRouteRefused(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}))
	ns := node.next(t)
	c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "nope"})
	if err != nil {
		t.Fatal(err)
	}
	pe := peerError(t, c)
	if pe.Code != tunnelpb.Error_REFUSED || !strings.Contains(pe.Message, "route nope not served") {
		t.Fatalf("got %v", pe)
	}
}

func closedPort(t testing.TB) string {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close()
	return addr
}

func TestDialFailed(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	target := "tcp://" + closedPort(t)
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "db", Target: target}))
	ns := node.next(t)
	for i := 0; i < 3; i++ {
		c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "db"})
		if err != nil {
			t.Fatal(err)
		}
		pe := peerError(t, c)
		if pe.Code != tunnelpb.Error_DIAL_FAILED || !strings.Contains(pe.Message, "dial "+target) {
			t.Fatalf("got %v", pe)
		}
	}
	// One warning line for the three failures (rate limited).
	if n := ag.logs.FilterMessage("upstream dial failed").Len(); n != 1 {
		t.Errorf("%d dial failure lines, want 1", n)
	}
}

func TestWrongTokenRetries(t *testing.T) {
	node := newFakeNode(t, "right", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "wrong", Upstream{Name: "web", Target: "http://127.0.0.1:1"}))
	waitFor(t, 10*time.Second, "three refused attempts", func() bool { return node.authFailed.Load() >= 3 })
	waitFor(t, 5*time.Second, "an authentication error line", func() bool {
		for _, e := range ag.logs.FilterMessage("authentication failed; retrying").All() {
			if e.Level == zapcore.ErrorLevel && e.ContextMap()["reason"] == "invalid token" &&
				e.ContextMap()["code"] == "Unauthenticated" {
				return true
			}
		}
		return false
	})
	if s := ag.State(); s == StateConnected {
		t.Fatalf("state %v", s)
	}
	select {
	case <-ag.Connected():
		t.Fatal("connected with a wrong token")
	default:
	}
}

func TestReconnectAfterServerRestart(t *testing.T) {
	up := helloServer(t, false)
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: up.URL}))
	node.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ag.WaitConnected(ctx); err != nil {
		t.Fatal(err)
	}

	node.stop()
	waitFor(t, 10*time.Second, "the agent to notice the restart", func() bool { return ag.State() != StateConnected })
	node2 := newFakeNode(t, "secret", nodeOptions{addr: node.addr})
	ns := node2.next(t)
	if err := ag.WaitConnected(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "web"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if resp, body := httpGet(t, c, "x", "/again"); resp.StatusCode != 200 || body != "hello x /again" {
		t.Fatalf("response %d %q", resp.StatusCode, body)
	}
	if !hasLog(ag.logs, "disconnected; reconnecting", "", "") {
		t.Error("no disconnect line")
	}
}

func TestDrainReconnects(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}))
	ns := node.next(t)
	ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: 0, Reason: "test"}}})
	waitFor(t, 10*time.Second, "the draining line", func() bool { return hasLog(ag.logs, "node draining", "reason", "test") })
	ns.cancel() // the node ends the session after the grace period
	node.next(t)
	waitFor(t, 10*time.Second, "the drained line", func() bool { return hasLog(ag.logs, "disconnected: node drained", "", "") })
}

func TestDrainWithoutCloseReconnects(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}),
		func(a *Agent) { a.drainMargin = 10 * time.Millisecond })
	ns := node.next(t)
	ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: 20}}})
	node.next(t) // the agent ended the drained session itself and reconnected
	select {
	case <-ns.sess.Done():
	case <-time.After(10 * time.Second):
		t.Fatal("drained session still open")
	}
}

// TestDrainReconnectSpread: a node's Drain with reconnect_spread_ms makes
// the agent draw its next attempt from [initial/2, spread], above its
// backoff's ceiling (200 ms here); a spread below 1 s is none (the agent
// backs off as before).
func TestDrainReconnectSpread(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}),
		func(a *Agent) { a.linkRandN = func(n int64) int64 { return n - 1 } }) // the top of each range
	drained := func() []map[string]any {
		var out []map[string]any
		for _, e := range ag.logs.FilterMessage("disconnected: node drained; reconnecting").All() {
			out = append(out, e.ContextMap())
		}
		return out
	}

	ns := node.next(t)
	ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{Reason: "test", ReconnectSpreadMs: 1200}}})
	waitFor(t, 10*time.Second, "the draining line", func() bool { return hasLog(ag.logs, "node draining", "reconnect_spread", "1.2s") })
	ended := time.Now()
	ns.cancel() // the node ends the session
	ns = node.next(t)
	if waited := time.Since(ended); waited < 1200*time.Millisecond {
		t.Errorf("reconnected %v after the drained session ended, want the spread's top, 1.2s", waited)
	}
	waitFor(t, 10*time.Second, "the drained line", func() bool { return len(drained()) == 1 })
	if f := drained()[0]; f["retry_in"] != "1.2s" || f["reconnect_spread"] != "1.2s" {
		t.Errorf("drained line %v, want retry_in and reconnect_spread 1.2s", f)
	}

	// Below 1 s: the backoff's own wait, the top of [10ms, 20ms].
	ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{Reason: "test", ReconnectSpreadMs: 999}}})
	waitFor(t, 10*time.Second, "the second draining line", func() bool { return ag.logs.FilterMessage("node draining").Len() == 2 })
	ns.cancel()
	node.next(t)
	waitFor(t, 10*time.Second, "the second drained line", func() bool { return len(drained()) == 2 })
	if f := drained()[1]; f["retry_in"] != "20ms" || f["reconnect_spread"] != nil {
		t.Errorf("drained line %v, want retry_in 20ms and no reconnect_spread", f)
	}
}

func TestAckTimeoutRetries(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{ack: func(*tunnelpb.Advertise, int) *tunnelpb.AdvertiseAck { return nil }})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}),
		func(a *Agent) { a.ackTimeout = 50 * time.Millisecond })
	node.next(t)
	node.next(t)
	waitFor(t, 5*time.Second, "the ack timeout line", func() bool {
		return hasLog(ag.logs, "connection failed; retrying", "reason", "no AdvertiseAck")
	})
}

func TestRejectedRouteReadvertised(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{ack: func(adv *tunnelpb.Advertise, n int) *tunnelpb.AdvertiseAck {
		ack := acceptAll(adv)
		if n == 1 {
			ack.Accepted = ack.Accepted[:1]
			ack.Rejected = []*tunnelpb.RejectedRoute{{Name: ":16379", ListenPort: 16379, Reason: "port in use"}}
		}
		return ack
	}})
	ag := startAgent(t, testConfig(node.addr, "secret",
		Upstream{Name: "web", Target: "http://127.0.0.1:1"},
		Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:1"}))
	ns := node.next(t)
	select {
	case adv := <-ns.advs:
		if len(adv.GetRoutes()) != 2 {
			t.Fatalf("re-advertise %v", adv)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("no second Advertise")
	}
	waitFor(t, 5*time.Second, "the accepted-after-retry line", func() bool {
		return hasLog(ag.logs, "route accepted after retry", "route", ":16379")
	})
	if !hasLog(ag.logs, "route rejected by node", "reason", "port in use") {
		t.Error("no rejection line")
	}
}

// echoUpstream serves a TCP echo on loopback until the test ends and
// returns its address.
func echoUpstream(t testing.TB) string {
	t.Helper()
	return serveUpstream(t, func(c net.Conn) { io.Copy(c, c); c.Close() })
}

// serveUpstream accepts TCP connections on loopback until the test ends,
// each served by handle in a goroutine of its own, and returns the address.
func serveUpstream(t testing.TB, handle func(net.Conn)) string {
	t.Helper()
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go handle(c)
		}
	}()
	return l.Addr().String()
}

func TestCancelStopsRunWithOpenConnection(t *testing.T) {
	// An echo upstream that keeps the connection open.
	echo := echoUpstream(t)
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echo}))
	ns := node.next(t)
	echoOnce(t, ns.sess)
	if n := ag.ActiveConns(); n != 1 {
		t.Fatalf("active %d", n)
	}
	if err := ag.stop(t); err != nil {
		t.Fatalf("Run returned %v", err)
	}
	if n := ag.ActiveConns(); n != 0 || ag.State() != StateStopped {
		t.Fatalf("after Run: active %d state %v", n, ag.State())
	}
}

func TestMaxConnections(t *testing.T) {
	echo := echoUpstream(t)
	node := newFakeNode(t, "secret", nodeOptions{})
	cfg := testConfig(node.addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echo})
	cfg.MaxConnections = 1
	ag := startAgent(t, cfg)
	ns := node.next(t)
	c1, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo"})
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	c1.SetDeadline(time.Now().Add(10 * time.Second))
	c1.Write([]byte("x"))
	if _, err := io.ReadFull(c1, make([]byte, 1)); err != nil {
		t.Fatal(err)
	}
	c2, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo"})
	if err != nil {
		t.Fatal(err)
	}
	if pe := peerError(t, c2); pe.Code != tunnelpb.Error_RESOURCE_EXHAUSTED {
		t.Fatalf("got %v", pe)
	}
	// Said at warn level, where an operator looks (throttled).
	warned := ag.logs.FilterMessage("connection limit reached; connection refused").FilterLevelExact(zapcore.WarnLevel)
	if warned.Len() != 1 {
		t.Fatalf("%d warnings of the refusal, want 1", warned.Len())
	}
}

// TestLimitsAreLoggedAndStarvedOnesWarned: the agent logs the limits it
// runs with, and warns when a tunnel_budget leaves the memory limit room
// for only a few connections (every further one is refused).
func TestLimitsAreLoggedAndStarvedOnesWarned(t *testing.T) {
	for _, tc := range []struct {
		name   string
		budget int64
		max    int
		warn   bool
	}{
		{"derived", 0, 0, tunnelcore.DeriveLimits(tunnelcore.MemoryLimit(), 0, 0, 0).MaxConnections < starvedConnections},
		{"budget takes the memory", tunnelcore.MemoryLimit(), 0, true},
		{"max_connections set", tunnelcore.MemoryLimit(), 2, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			core, logs := observer.New(zap.InfoLevel)
			cfg := testConfig("127.0.0.1:1", "secret", Upstream{Name: "echo", Target: "tcp://127.0.0.1:2"})
			cfg.TunnelBudget, cfg.MaxConnections = tc.budget, tc.max
			if _, err := New(cfg, zap.New(core)); err != nil {
				t.Fatal(err)
			}
			if logs.FilterMessage("limits").Len() != 1 {
				t.Error("the limits were not logged")
			}
			if got := logs.FilterLevelExact(zapcore.WarnLevel).Len() == 1; got != tc.warn {
				t.Errorf("warned %v, want %v: %v", got, tc.warn, logs.All())
			}
		})
	}
}

func TestProxyProtocolHeaders(t *testing.T) {
	for _, tc := range []struct {
		version string
		want    []byte
	}{
		{"v1", []byte("PROXY TCP4 203.0.113.7 198.51.100.1 5555 16379\r\n")},
		{"v2", []byte("\r\n\r\n\x00\r\nQUIT\n\x21\x11\x00\x0c" +
			"\xcb\x00\x71\x07" + "\xc6\x33\x64\x01" + "\x15\xb3" + "\x3f\xfb")},
	} {
		t.Run(tc.version, func(t *testing.T) {
			l, err := net.Listen("tcp", "127.0.0.1:0")
			if err != nil {
				t.Fatal(err)
			}
			defer l.Close()
			got := make(chan []byte, 1)
			go func() {
				c, err := l.Accept()
				if err != nil {
					return
				}
				defer c.Close()
				c.SetDeadline(time.Now().Add(10 * time.Second))
				buf := make([]byte, len(tc.want)+len("payload"))
				n, _ := io.ReadFull(c, buf)
				got <- buf[:n]
				c.Write([]byte("ok"))
			}()
			node := newFakeNode(t, "secret", nodeOptions{})
			startAgent(t, testConfig(node.addr, "secret",
				Upstream{ListenPort: 16379, Target: "tcp://" + l.Addr().String(), ProxyProtocol: tc.version}))
			ns := node.next(t)
			c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: ":16379", RemoteAddr: "203.0.113.7:5555", LocalAddr: "198.51.100.1:16379"})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.SetDeadline(time.Now().Add(10 * time.Second))
			c.Write([]byte("payload"))
			select {
			case b := <-got:
				want := append(append([]byte{}, tc.want...), "payload"...)
				if string(b) != string(want) {
					t.Fatalf("upstream read\n% x\nwant\n% x", b, want)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("upstream read nothing")
			}
			if b, err := io.ReadAll(c); err != nil || string(b) != "ok" {
				t.Fatalf("reply %q %v", b, err)
			}
		})
	}
}

func TestHTTPSUpstream(t *testing.T) {
	up := helloServer(t, true)
	target := "https://" + up.Listener.Addr().String()
	node := newFakeNode(t, "secret", nodeOptions{})
	startAgent(t, testConfig(node.addr, "secret",
		Upstream{Name: "secure", Host: "secure.test", Target: target, InsecureSkipVerify: true},
		Upstream{Name: "strict", Host: "strict.test", Target: target}))
	ns := node.next(t)

	c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "secure"})
	if err != nil {
		t.Fatal(err)
	}
	resp, body := httpGet(t, c, "app.test", "/tls")
	c.Close()
	if resp.StatusCode != 200 || body != "hello app.test /tls" {
		t.Fatalf("response %d %q", resp.StatusCode, body)
	}

	c, err = ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "strict"})
	if err != nil {
		t.Fatal(err)
	}
	pe := peerError(t, c)
	if pe.Code != tunnelpb.Error_DIAL_FAILED || !strings.Contains(pe.Message, "certificate") {
		t.Fatalf("got %v", pe)
	}
}

// testPKI makes a CA and a server certificate for 127.0.0.1 signed by it.
func testPKI(t testing.TB) (caPEM []byte, cert tls.Certificate) {
	t.Helper()
	ca := newTestCA(t)
	return ca.pem, ca.serverCert(t, "127.0.0.1")
}

func TestGRPCSWithCAFile(t *testing.T) {
	caPEM, cert := testPKI(t)
	creds := credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{cert}})
	node := newFakeNode(t, "secret", nodeOptions{creds: creds})
	cfg := testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"})
	cfg.Server = "grpcs://" + node.addr
	cfg.CAFile = writeFile(t, "ca.pem", string(caPEM))
	ag := startAgent(t, cfg)
	node.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ag.WaitConnected(ctx); err != nil {
		t.Fatal(err)
	}

	// Without the CA the handshake fails and the agent keeps retrying.
	cfg2 := testConfig(node.addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"})
	cfg2.Server = "grpcs://" + node.addr
	ag2 := startAgent(t, cfg2)
	waitFor(t, 10*time.Second, "a certificate failure line", func() bool {
		return hasLog(ag2.logs, "connection failed; retrying", "reason", "certificate")
	})
}

func TestNewRejectsBadConfig(t *testing.T) {
	cfg := testConfig("127.0.0.1:1", "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"})
	cfg.Server = "grpcs://127.0.0.1:1"
	cfg.CAFile = writeFile(t, "ca.pem", "not a certificate")
	if _, err := New(cfg, zap.NewNop()); err == nil || !strings.Contains(err.Error(), "ca_file") {
		t.Fatalf("New: %v", err)
	}
	if err := Run(context.Background(), cfg, nil); err == nil {
		t.Fatal("Run accepted a bad CA file")
	}
}

// TestConnectHintFitsTheError: each hint answers the error text that a
// wrong setting produces, and errors with other causes get none.
func TestConnectHintFitsTheError(t *testing.T) {
	for _, tc := range []struct {
		msg    string
		useTLS bool
		want   string // substring; "" for no hint
	}{
		{`connection error: desc = "error reading server preface: http2: frame too large, note that the frame header looked like an HTTP/1.1 header"`, false, "speaks HTTP/1.1"},
		{`unexpected HTTP status code received from server: 503 (Service Unavailable)`, false, "not as a sluice control plane"},
		{`connection error: desc = "error reading server preface: EOF"`, false, "use grpcs://"},
		{`connection error: desc = "error reading server preface: read tcp 127.0.0.1:1->127.0.0.1:2: read: connection reset by peer"`, false, ""},
		{`connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`, true, "does not speak TLS"},
		{`connection error: desc = "transport: authentication handshake failed: tls: failed to verify certificate: x509: certificate signed by unknown authority"`, true, "ca_file"},
		{`connection error: desc = "transport: Error while dialing: dial tcp 127.0.0.1:1: connect: connection refused"`, false, "nothing listens there"},
		{`name resolver error: produced zero addresses`, false, "does not resolve"},
		{`connection error: desc = "error reading server preface: remote error: tls: certificate required"`, true, "set cert_file and key_file"},
		{`connection error: desc = "error reading server preface: remote error: tls: unknown certificate authority"`, true, "refused the client certificate"},
		{`connection error: desc = "error reading server preface: remote error: tls: expired certificate"`, true, "refused the client certificate"},
		{`connection error: desc = "error reading server preface: remote error: tls: bad certificate"`, true, "refused the client certificate"},
		{`rpc error: code = Unavailable desc = node draining`, false, ""},
	} {
		got := connectHint(tc.msg, tc.useTLS)
		if (tc.want == "") != (got == "") || !strings.Contains(got, tc.want) {
			t.Errorf("connectHint(%q, tls=%v) = %q, want one containing %q", tc.msg, tc.useTLS, got, tc.want)
		}
	}
}

// TestBurstOfAcksEndsInTheLastState: acks the agent has not handled yet
// are superseded by newer ones, never dropped for newer ones. A node
// re-admitting routes on every reload can send many in a row; the agent
// must end up acting on the last (here a rejection, which it retries),
// whatever came before it.
func TestBurstOfAcksEndsInTheLastState(t *testing.T) {
	const burst = 400
	node := newFakeNode(t, "secret", nodeOptions{})
	ag := startAgent(t, testConfig(node.addr, "secret",
		Upstream{Name: "web", Target: "http://127.0.0.1:1"},
		Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:1"}),
		// Retries wait long enough for the whole burst to arrive first.
		func(a *Agent) { a.backoffInitial, a.backoffMax = 2*time.Second, 2*time.Second })
	ns := node.next(t)
	waitFor(t, 10*time.Second, "connected", func() bool { return ag.State() == StateConnected })

	accepted := acceptAll(ns.adv)
	rejected := acceptAll(ns.adv)
	rejected.Accepted = rejected.Accepted[:1]
	rejected.Rejected = []*tunnelpb.RejectedRoute{{Name: ":16379", ListenPort: 16379, Reason: "port in use"}}
	for i := range burst {
		ack := accepted
		if i%2 == 0 {
			ack = rejected
		}
		if err := ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}}); err != nil {
			t.Fatal(err)
		}
	}
	if err := ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: rejected}}); err != nil {
		t.Fatal(err)
	}
	select {
	case adv := <-ns.advs:
		if len(adv.GetRoutes()) != 2 {
			t.Fatalf("re-advertise %v", adv)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the last ack rejected a route, and the agent never advertised it again")
	}
	if n := ag.logs.FilterMessage("route rejected by node").Len(); n > burst/2+1 {
		t.Fatalf("%d rejection lines for %d rejections", n, burst/2+1)
	}
}

// TestDialEndsWithItsSession: an upstream dial still under way when its
// session ends is given up, so its max_connections slot serves the next
// session at once instead of after the dial timeout.
func TestDialEndsWithItsSession(t *testing.T) {
	// Accepts TCP and never answers the TLS handshake.
	up := serveUpstream(t, func(c net.Conn) { <-t.Context().Done(); c.Close() })
	node := newFakeNode(t, "secret", nodeOptions{})
	cfg := testConfig(node.addr, "secret", Upstream{Name: "web", Target: "https://" + up})
	cfg.MaxConnections = 1
	ag := startAgent(t, cfg)
	ns := node.next(t)
	if _, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "web"}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 5*time.Second, "the dial under way", func() bool { return ag.ActiveConns() == 1 })
	ns.cancel() // the session ends (a node restart, a network blip)
	node.next(t)
	waitFor(t, 5*time.Second, "the dead session's dial given up", func() bool { return ag.ActiveConns() == 0 })
	if hasLog(ag.logs, "upstream dial failed", "", "") {
		t.Error("a dial the agent gave up was logged as the upstream's failure")
	}
}

// TestEarlyAnswerBeforeAResetIsDelivered: an upstream that answers an
// upload early (a 413) and closes with the body unread resets the
// connection right after its answer. A client of the upstream itself reads
// the answer; through the agent it must too, not only the reset.
func TestEarlyAnswerBeforeAResetIsDelivered(t *testing.T) {
	const answer = "HTTP/1.1 413 Payload Too Large\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
	up := serveUpstream(t, func(c net.Conn) { // reads the request line, answers, closes with the body unread
		bufio.NewReader(c).ReadString('\n')
		c.Write([]byte(answer))
		c.Close()
	})
	node := newFakeNode(t, "secret", nodeOptions{})
	startAgent(t, testConfig(node.addr, "secret", Upstream{Name: "up", Host: "app.test", Target: "http://" + up}))
	ns := node.next(t)
	body := bytes.Repeat([]byte("x"), 4<<20)
	for i := range 20 {
		c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "up"})
		if err != nil {
			t.Fatal(err)
		}
		c.SetDeadline(time.Now().Add(10 * time.Second))
		go func() {
			c.Write([]byte("POST /upload HTTP/1.1\r\n"))
			c.Write(body)
		}()
		got, err := io.ReadAll(io.LimitReader(c, int64(len(answer))))
		c.Close()
		if string(got) != answer {
			t.Fatalf("upload %d: the node read %q (%v), want the upstream's answer", i, got, err)
		}
	}
}

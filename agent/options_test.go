package agent

import (
	"context"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/route"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Tests of the options issue 27 added: keepalive_time, keepalive_timeout,
// tunnel_stall_timeout, and targets without a scheme.

func TestTargetWithoutScheme(t *testing.T) {
	cases := []struct {
		up         Upstream
		wantTarget string
		wantKind   route.Kind
	}{
		{Upstream{Host: "app.test", Target: "127.0.0.1:8080"}, "http://127.0.0.1:8080", route.Host},
		{Upstream{Host: "app.test", Target: " localhost:3000 "}, "http://localhost:3000", route.Host},
		{Upstream{Host: "*", Target: "[::1]:3000"}, "http://[::1]:3000", route.CatchAll},
		{Upstream{HostPattern: `.*\.test`, Target: "LOCALHOST:3000"}, "http://LOCALHOST:3000", route.HostPattern},
		// Explicit schemes stay as they are.
		{Upstream{Host: "app.test", Target: "HTTPS://127.0.0.1:8443"}, "https://127.0.0.1:8443", route.Host},
		{Upstream{Host: "app.test", Target: "tcp://127.0.0.1:8080"}, "tcp://127.0.0.1:8080", route.TCPHost},
		{Upstream{Name: "dns", Target: "udp://127.0.0.1:53"}, "udp://127.0.0.1:53", route.NamedUDP},
		{Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:6379"}, "tcp://127.0.0.1:6379", route.ListenPort},
	}
	for _, tc := range cases {
		c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", Upstreams: []Upstream{tc.up}}
		if err := c.Validate(); err != nil {
			t.Errorf("%+v: %v", tc.up, err)
			continue
		}
		u := c.Upstreams[0]
		if u.Target != tc.wantTarget || u.Kind() != tc.wantKind {
			t.Errorf("%q: target %q kind %v, want %q %v", tc.up.Target, u.Target, u.Kind(), tc.wantTarget, tc.wantKind)
		}
		scheme, hostport := u.TargetURL()
		if scheme+"://"+hostport != tc.wantTarget {
			t.Errorf("%q: TargetURL %s %s", tc.up.Target, scheme, hostport)
		}
		// Validate twice: the normalised form stays.
		if err := c.Validate(); err != nil || c.Upstreams[0].Target != tc.wantTarget {
			t.Errorf("%q: second Validate: %v, target %q", tc.up.Target, err, c.Upstreams[0].Target)
		}
	}
}

func TestTargetWithoutSchemeErrors(t *testing.T) {
	cases := []struct {
		up   Upstream
		want string
	}{
		{Upstream{ListenPort: 16379, Target: "127.0.0.1:6379"}, "upstreams[0].listen_port: requires a tcp:// target (a target without a scheme means http://)"},
		{Upstream{Host: "db.test", TLSPassthrough: true, Target: "127.0.0.1:5432"}, "upstreams[0].tls_passthrough: requires a tcp:// target (a target without a scheme means http://)"},
		{Upstream{Host: "app.test", Target: "127.0.0.1"}, `upstreams[0].target: "http://127.0.0.1": port required`},
		{Upstream{Host: "app.test", Target: "unix:///run/app.sock"}, `upstreams[0].target: scheme "unix" not supported`},
		{Upstream{Host: "app.test", Target: "127.0.0.1:8080", ProxyProtocol: "v1"}, "upstreams[0].proxy_protocol: only valid with a tcp:// target"},
	}
	for _, tc := range cases {
		c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", Upstreams: []Upstream{tc.up}}
		err := c.Validate()
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%+v: error %v, want %q", tc.up, err, tc.want)
		}
	}
}

func TestParseUpstreamWithoutScheme(t *testing.T) {
	for spec, want := range map[string]string{
		"app.test=127.0.0.1:3000":                   "http://127.0.0.1:3000",
		"host=app.test,target=localhost:3000":       "http://localhost:3000",
		"*=127.0.0.1:3000":                          "http://127.0.0.1:3000",
		"app.test=tcp://127.0.0.1:3000,force_http1": "tcp://127.0.0.1:3000",
	} {
		u, err := ParseUpstream(spec)
		if err != nil {
			t.Errorf("%s: %v", spec, err)
			continue
		}
		c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", Upstreams: []Upstream{u}}
		if err := c.Validate(); err != nil {
			t.Errorf("%s: %v", spec, err)
		} else if got := c.Upstreams[0].Target; got != want {
			t.Errorf("%s: target %q, want %q", spec, got, want)
		}
	}
}

func TestKeepaliveAndStallDefaults(t *testing.T) {
	c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", Upstreams: []Upstream{{Host: "a.test", Target: "127.0.0.1:1"}}}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.KeepaliveTime != 30*time.Second || c.KeepaliveTimeout != 10*time.Second || c.TunnelStallTimeout != 60*time.Second {
		t.Errorf("defaults: keepalive_time %v keepalive_timeout %v tunnel_stall_timeout %v", c.KeepaliveTime, c.KeepaliveTimeout, c.TunnelStallTimeout)
	}
	c.TunnelStallTimeout = -time.Second // off
	c.KeepaliveTime, c.KeepaliveTimeout = 10*time.Second, time.Second
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.TunnelStallTimeout != -time.Second || c.KeepaliveTime != 10*time.Second || c.KeepaliveTimeout != time.Second {
		t.Errorf("set values changed: %v %v %v", c.KeepaliveTime, c.KeepaliveTimeout, c.TunnelStallTimeout)
	}
}

func TestKeepaliveErrors(t *testing.T) {
	cases := []struct {
		mutate func(*Config)
		want   string
	}{
		{func(c *Config) { c.KeepaliveTime = 5 * time.Second }, "keepalive_time: at least 10s (a node answers more frequent pings with GOAWAY too_many_pings), got 5s"},
		{func(c *Config) { c.KeepaliveTime = -time.Second }, "keepalive_time: at least 10s"},
		{func(c *Config) { c.KeepaliveTimeout = 500 * time.Millisecond }, "keepalive_timeout: at least 1s, got 500ms"},
		{func(c *Config) { c.KeepaliveTimeout = -time.Second }, "keepalive_timeout: at least 1s"},
	}
	for _, tc := range cases {
		c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", Upstreams: []Upstream{{Host: "a.test", Target: "127.0.0.1:1"}}}
		tc.mutate(c)
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v, want %q", err, tc.want)
		}
	}
}

func TestKeepaliveSources(t *testing.T) {
	path := writeFile(t, "agent.yaml", "server: grpc://127.0.0.1:1\ntoken: t\nupstreams: [{host: a.test, target: 127.0.0.1:1}]\n"+
		"keepalive_time: 40s\nkeepalive_timeout: 15s\ntunnel_stall_timeout: 90s\n")
	env := map[string]string{}
	getenv := func(k string) string { return env[k] }

	c, err := ParseFlags([]string{"-config", path}, getenv)
	if err != nil {
		t.Fatal(err)
	}
	if c.KeepaliveTime != 40*time.Second || c.KeepaliveTimeout != 15*time.Second || c.TunnelStallTimeout != 90*time.Second {
		t.Errorf("file: %v %v %v", c.KeepaliveTime, c.KeepaliveTimeout, c.TunnelStallTimeout)
	}

	env[EnvKeepaliveTime], env[EnvKeepaliveTO], env[EnvStallTimeout] = "50s", "20s", "-1s"
	if c, err = ParseFlags([]string{"-config", path}, getenv); err != nil {
		t.Fatal(err)
	}
	if c.KeepaliveTime != 50*time.Second || c.KeepaliveTimeout != 20*time.Second || c.TunnelStallTimeout != -time.Second {
		t.Errorf("environment: %v %v %v", c.KeepaliveTime, c.KeepaliveTimeout, c.TunnelStallTimeout)
	}

	if c, err = ParseFlags([]string{"-config", path, "-keepalive-time", "1m", "-keepalive-timeout", "5s", "-tunnel-stall-timeout", "2m"}, getenv); err != nil {
		t.Fatal(err)
	}
	if c.KeepaliveTime != time.Minute || c.KeepaliveTimeout != 5*time.Second || c.TunnelStallTimeout != 2*time.Minute {
		t.Errorf("flags: %v %v %v", c.KeepaliveTime, c.KeepaliveTimeout, c.TunnelStallTimeout)
	}

	env[EnvKeepaliveTime] = "soon"
	if _, err := ParseFlags([]string{"-config", path}, getenv); err == nil || !strings.Contains(err.Error(), EnvKeepaliveTime+`: invalid duration "soon"`) {
		t.Errorf("invalid environment duration: %v", err)
	}
	delete(env, EnvKeepaliveTime)
	if _, err := ParseFlags([]string{"-config", path, "-keepalive-time", "2s"}, getenv); err == nil || !strings.Contains(err.Error(), "keepalive_time: at least 10s") {
		t.Errorf("keepalive time below the node's policy: %v", err)
	}
	bad := writeFile(t, "bad.yaml", "server: grpc://127.0.0.1:1\ntoken: t\nupstreams: [{host: a.test, target: 127.0.0.1:1}]\nkeepalive_timeout: 10\n")
	if _, err := ParseFlags([]string{"-config", bad}, getenv); err == nil || !strings.Contains(err.Error(), "keepalive_timeout (line 4): `10` is not a duration") {
		t.Errorf("YAML integer as a duration: %v", err)
	}
	var usage strings.Builder
	Usage(&usage)
	for _, want := range []string{"-keepalive-time", "-keepalive-timeout", "-tunnel-stall-timeout", EnvKeepaliveTime, EnvKeepaliveTO, EnvStallTimeout} {
		if !strings.Contains(usage.String(), want) {
			t.Errorf("usage does not mention %s", want)
		}
	}
}

func TestSessionTakesStallTimeout(t *testing.T) {
	for _, d := range []time.Duration{0, -time.Second, 5 * time.Second} {
		c := &Config{Server: "grpc://127.0.0.1:1", Token: "t", TunnelStallTimeout: d, Upstreams: []Upstream{{Host: "a.test", Target: "127.0.0.1:1"}}}
		a, err := New(c, nil)
		if err != nil {
			t.Fatal(err)
		}
		l := newLink(a, originServer, serverTarget(c))
		s := &sessionAttempt{a: a, l: l, ctl: newLinkControl(l, serverTarget(c))}
		want := d
		if d == 0 {
			want = DefaultTunnelStallTimeout
		}
		if got := s.coreConfig().StallTimeout; got != want {
			t.Errorf("tunnel_stall_timeout %v: session's StallTimeout %v, want %v", d, got, want)
		}
		l.stopAgentLeave()
	}
}

// freezingProxy relays TCP connections to addr until frozen. From then on
// the connections it relays stay open and carry nothing either way, as
// through a NAT or firewall that dropped them silently: with drop, it
// reads what the agent sends and discards it; otherwise it stops reading
// what the agent sends, as a node that stopped reading, while the node's
// bytes still reach the agent. Connections opened once frozen relay.
type freezingProxy struct {
	addr   string
	drop   bool
	frozen atomic.Bool
	halt   chan struct{} // closed at cleanup: a reader that stopped returns
	mu     sync.Mutex
	conns  []net.Conn
}

func newFreezingProxy(t *testing.T, to string, drop bool) *freezingProxy {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	p := &freezingProxy{addr: ln.Addr().String(), drop: drop, halt: make(chan struct{})}
	var wg sync.WaitGroup
	t.Cleanup(func() {
		ln.Close()
		close(p.halt)
		p.mu.Lock()
		for _, c := range p.conns {
			c.Close()
		}
		p.mu.Unlock()
		wg.Wait()
	})
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			u, err := net.Dial("tcp", to)
			if err != nil {
				c.Close()
				continue
			}
			relays := !p.frozen.Load() // a connection opened frozen relays
			p.mu.Lock()
			p.conns = append(p.conns, c, u)
			p.mu.Unlock()
			for i, pair := range [][2]net.Conn{{c, u}, {u, c}} {
				fromAgent := i == 0
				wg.Add(1)
				go func() {
					defer wg.Done()
					p.relay(pair[0], pair[1], relays && (fromAgent || p.drop))
				}()
			}
		}
	}()
	return p
}

// relay copies from to to; freezes says whether the proxy's freeze
// applies to this direction.
func (p *freezingProxy) relay(from, to net.Conn, freezes bool) {
	buf := make([]byte, 32<<10)
	for {
		if freezes && !p.drop && p.frozen.Load() {
			<-p.halt // stops reading: the sender's socket fills
			return
		}
		n, err := from.Read(buf)
		if err != nil {
			to.Close()
			return
		}
		if freezes && p.drop && p.frozen.Load() {
			continue // dropped, as by a dead middlebox
		}
		if _, err := to.Write(buf[:n]); err != nil {
			return
		}
	}
}

// TestKeepaliveNoticesADeadLink: with keepalive_time 10s (the least a node
// permits) and keepalive_timeout 1s, a connection to the node that goes
// silent is torn down by the unanswered ping, and the agent reconnects;
// without pings nothing would ever tell it from an idle one.
func TestKeepaliveNoticesADeadLink(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	proxy := newFreezingProxy(t, node.addr, true)
	cfg := testConfig(proxy.addr, "secret", Upstream{Host: "a.test", Target: "127.0.0.1:1"})
	cfg.KeepaliveTime, cfg.KeepaliveTimeout = MinKeepaliveTime, time.Second
	ag := startAgent(t, cfg)
	node.next(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := ag.WaitConnected(ctx); err != nil {
		t.Fatal(err)
	}
	proxy.frozen.Store(true)
	select {
	case <-node.sessions:
	case <-time.After(MinKeepaliveTime + 20*time.Second):
		t.Fatalf("no new session after the link went silent; agent state %v", ag.State())
	}
	if !hasLog(ag.logs, "disconnected", "reason", "keepalive ping failed") {
		t.Error("the session did not end on the unanswered keepalive ping")
	}
}

// TestStallTimeoutReconnects: a node that stops reading the session while
// the agent has frames for it (here: the proxy in between stops reading,
// so the agent's socket fills and its sends block) is cut after
// tunnel_stall_timeout, long before the keepalive would notice, and the
// agent reconnects.
func TestStallTimeoutReconnects(t *testing.T) {
	const conns = 8
	source := serveUpstream(t, func(c net.Conn) { // sends until the connection ends
		buf := make([]byte, 32<<10)
		for {
			if _, err := c.Write(buf); err != nil {
				c.Close()
				return
			}
		}
	})
	node := newFakeNode(t, "secret", nodeOptions{})
	proxy := newFreezingProxy(t, node.addr, false)
	cfg := testConfig(proxy.addr, "secret", Upstream{Name: "source", Target: "tcp://" + source})
	cfg.TunnelStallTimeout = 500 * time.Millisecond
	ag := startAgent(t, cfg)
	ns := node.next(t)

	// The node reads every connection for as long as it gets bytes, so
	// their windows grow and stay grown (a reader that stopped would have
	// its credit reclaimed after a second, and then the agent might hold
	// less than the sockets in between take); once the proxy stops reading,
	// what the agent has credit for is more than those sockets hold.
	var read atomic.Int64
	var wg sync.WaitGroup
	defer wg.Wait()
	for range conns {
		c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "source"})
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		wg.Add(1)
		go func() {
			defer wg.Done()
			buf := make([]byte, 64<<10)
			for {
				n, err := c.Read(buf)
				read.Add(int64(n))
				if err != nil {
					return
				}
			}
		}()
	}
	waitFor(t, 60*time.Second, "the node to read 4 MiB a connection", func() bool { return read.Load() >= conns*4<<20 })
	proxy.frozen.Store(true)
	select {
	case <-node.sessions:
	case <-time.After(30 * time.Second): // the keepalive would take 40 s
		t.Fatalf("no new session after the node stopped reading; agent state %v, stats %+v", ag.State(), ag.Stats())
	}
	if !hasLog(ag.logs, "tunnel stream stalled", "", "") {
		t.Error("the session did not end on the stall watchdog")
	}
}

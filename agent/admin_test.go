package agent

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"net"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestAdminListenLayers: admin_listen comes from the config file, the
// environment or the flag, each overriding the one before.
func TestAdminListenLayers(t *testing.T) {
	cfgFile := writeFile(t, "agent.yaml", `
server: grpc://file:1
token: t
admin_listen: 127.0.0.1:9001
upstreams:
  - host: file.example.com
    target: http://127.0.0.1:1
`)
	for _, tc := range []struct {
		name string
		env  map[string]string
		args []string
		want string
	}{
		{"file", map[string]string{EnvConfig: cfgFile}, nil, "127.0.0.1:9001"},
		{"env", map[string]string{EnvConfig: cfgFile, EnvAdminListen: "127.0.0.1:9002"}, nil, "127.0.0.1:9002"},
		{"flag", map[string]string{EnvConfig: cfgFile, EnvAdminListen: "127.0.0.1:9002"}, []string{"-admin-listen", "[::1]:9003"}, "[::1]:9003"},
		{"unset", map[string]string{EnvServer: "grpc://x:1", EnvToken: "t", EnvUpstreams: "*=http://127.0.0.1:1"}, nil, ""},
	} {
		c, err := ParseFlags(tc.args, envFunc(tc.env))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if c.AdminListen != tc.want {
			t.Errorf("%s: admin_listen %q, want %q", tc.name, c.AdminListen, tc.want)
		}
	}
}

// TestAdminListenInvalid: an admin_listen that cannot be bound as written
// fails at load, naming the field.
func TestAdminListenInvalid(t *testing.T) {
	for _, addr := range []string{"9001", "127.0.0.1", "127.0.0.1:http", "127.0.0.1:70000", "a b:1", "http://127.0.0.1:9001"} {
		c := testConfig("127.0.0.1:1", "t", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"})
		c.AdminListen = addr
		err := c.Validate()
		if err == nil || !strings.HasPrefix(err.Error(), "admin_listen: ") {
			t.Errorf("%q: err = %v, want one naming admin_listen", addr, err)
		}
	}
	for _, addr := range []string{"127.0.0.1:9001", ":9001", "[::1]:0", "localhost:9001", " 127.0.0.1:9001 "} {
		c := testConfig("127.0.0.1:1", "t", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"})
		c.AdminListen = addr
		if err := c.Validate(); err != nil {
			t.Errorf("%q: %v", addr, err)
		}
	}
}

// TestAdminExposedWarns: binding beyond loopback is allowed, with a warning.
func TestAdminExposedWarns(t *testing.T) {
	for addr, warn := range map[string]bool{
		"127.0.0.1:9001": false, "[::1]:9001": false, "localhost:9001": false, "127.0.0.2:0": false,
		":9001": true, "0.0.0.0:9001": true, "10.0.0.1:9001": true, "agent.example.com:9001": true,
	} {
		core, logs := observer.New(zap.WarnLevel)
		warnAdminExposed(zap.New(core), addr)
		if got := logs.Len() == 1; got != warn {
			t.Errorf("%s: warned %v, want %v", addr, got, warn)
		}
	}
}

// TestRunFailsOnBusyAdminListen: an admin address that cannot be bound
// ends Run with an error naming the field.
func TestRunFailsOnBusyAdminListen(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cfg := testConfig("127.0.0.1:1", "t", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"})
	cfg.AdminListen = ln.Addr().String()
	a, err := New(cfg, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := a.Run(context.Background()); err == nil || !strings.Contains(err.Error(), "admin_listen") {
		t.Fatalf("Run: %v", err)
	}
}

// adminGet fetches path from the agent's admin listener.
func adminGet(t testing.TB, a *Agent, path string) (int, string) {
	t.Helper()
	addr := a.AdminAddr()
	if addr == nil {
		t.Fatalf("GET %s: the admin listener is not listening", path)
	}
	resp, err := http.Get("http://" + addr.String() + path)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("GET %s: %v", path, err)
	}
	return resp.StatusCode, string(b)
}

// adminStatus fetches and decodes /status.
func adminStatus(t testing.TB, a *Agent) Status {
	t.Helper()
	code, body := adminGet(t, a, "/status")
	var st Status
	if code != 200 {
		t.Fatalf("/status: %d %s", code, body)
	}
	if err := json.Unmarshal([]byte(body), &st); err != nil {
		t.Fatalf("/status: %v\n%s", err, body)
	}
	return st
}

// TestAdminEndpoints: the admin listener reports the session, the routes'
// acks and port claims, the bytes relayed per route and the readiness,
// and follows the node going away.
func TestAdminEndpoints(t *testing.T) {
	echo := echoUpstream(t)
	node := newFakeNode(t, "secret", nodeOptions{ack: func(adv *tunnelpb.Advertise, _ int) *tunnelpb.AdvertiseAck {
		ack := acceptAll(adv)
		ack.Build = "sluice-node v9.9.9 (go1.26)"
		ack.Accepted = ack.Accepted[:1]
		ack.Rejected = []*tunnelpb.RejectedRoute{{Name: ":16379", ListenPort: 16379, Reason: "port in use"}}
		return ack
	}})
	cfg := testConfig(node.addr, "secret",
		Upstream{Name: "echo", Target: "tcp://" + echo},
		Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:1"})
	cfg.AdminListen = "127.0.0.1:0"
	cfg.MaxConnections = 7
	ag := startAgent(t, cfg)
	ns := node.next(t)
	waitFor(t, 5*time.Second, "readiness", func() bool { code, _ := adminGet(t, ag.Agent, "/readyz"); return code == 200 })
	if !hasLog(ag.logs, "connected", "node_build", "sluice-node v9.9.9") {
		t.Error(`no "connected" line naming the node's build`)
	}
	relayEcho(t, ns.sess, "hello")
	waitFor(t, 5*time.Second, "the connection's end", func() bool { return ag.ActiveConns() == 0 })

	checkStatusConnected(t, adminStatus(t, ag.Agent))
	_, metrics := adminGet(t, ag.Agent, "/metrics")
	for _, line := range []string{
		"sluice_tunnel_sessions 1",
		`sluice_tunnel_bytes_total{direction="from_client",route="echo"} 5`,
		`sluice_tunnel_bytes_total{direction="to_client",route="echo"} 5`,
		`sluice_connections_total{outcome="ok",route="echo"} 1`,
		"sluice_connections_limit 7",
		"sluice_connections_active 0",
		"sluice_reconnect_total 0",
		"go_goroutines ",
		"process_open_fds ",
	} {
		if !strings.Contains(metrics, "\n"+line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}
	if !strings.Contains(metrics, `sluice_advertise_rejected_total{route=":16379"} `) {
		t.Error("/metrics lacks the advertise rejections")
	}
	if problems, err := testutil.CollectAndLint(ag.MetricsCollector()); err != nil || len(problems) > 0 {
		t.Errorf("metric lint: %v %+v", err, problems)
	}
	if code, body := adminGet(t, ag.Agent, "/healthz"); code != 200 || body != "ok\n" {
		t.Errorf("/healthz: %d %q", code, body)
	}

	node.stop()
	waitFor(t, 5*time.Second, "unreadiness", func() bool { code, _ := adminGet(t, ag.Agent, "/readyz"); return code == 503 })
	if _, body := adminGet(t, ag.Agent, "/readyz"); !strings.Contains(body, "no session with "+cfg.Server) {
		t.Errorf("/readyz reason %q", body)
	}
	waitFor(t, 5*time.Second, "a reconnect attempt", func() bool {
		_, m := adminGet(t, ag.Agent, "/metrics")
		return strings.Contains(m, "\nsluice_tunnel_sessions 0") && !strings.Contains(m, "\nsluice_reconnect_total 0\n")
	})
	st := adminStatus(t, ag.Agent)
	if s := st.Sessions[0]; s.State == "connected" || s.NodeBuild != "" || s.LastError == "" || st.Routes[0].Ack != AckPending {
		t.Errorf("after the node stopped: %+v", st)
	}
}

// relayEcho sends msg through the echo route and reads it back.
func relayEcho(t testing.TB, sess *tunnelcore.Session, msg string) {
	t.Helper()
	c, err := sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo"})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte(msg)); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(msg))
	if _, err := io.ReadFull(c, got); err != nil || string(got) != msg {
		t.Fatalf("echo %q, %v", got, err)
	}
	c.CloseWrite()
	if _, err := io.Copy(io.Discard, c); err != nil && !errors.Is(err, io.EOF) {
		t.Fatal(err)
	}
}

// checkStatusConnected checks /status of TestAdminEndpoints' agent while
// connected, field by field.
func checkStatusConnected(t *testing.T, st Status) {
	t.Helper()
	if !st.Ready || st.Reason != "" || st.AgentID != "agent-test" || !strings.HasPrefix(st.Build, "sluice-agent ") {
		t.Errorf("status %+v", st)
	}
	if len(st.Sessions) != 1 {
		t.Fatalf("sessions %+v", st.Sessions)
	}
	s := st.Sessions[0]
	if s.State != "connected" || s.NodeID != "node-1" || s.NodeBuild != "sluice-node v9.9.9 (go1.26)" ||
		s.Transport != TransportGRPCStream || s.Established != 1 || s.Reconnects != 0 || s.Since.IsZero() {
		t.Errorf("session %+v", s)
	}
	if len(st.Routes) != 2 {
		t.Fatalf("routes %+v", st.Routes)
	}
	if r := st.Routes[0]; r.Name != "echo" || r.Kind != "named tcp service" || r.Ack != AckAccepted || r.BytesFromClient != 5 || r.BytesToClient != 5 {
		t.Errorf("route %+v", r)
	}
	if r := st.Routes[1]; r.Name != ":16379" || r.Kind != "listen port" || r.ListenPort != 16379 || r.Ack != AckRejected || r.Reason != "port in use" {
		t.Errorf("route %+v", r)
	}
	want := []PortClaim{{Port: 16379, Route: ":16379", Ack: AckRejected, Reason: "port in use"}}
	if len(st.PortClaims) != 1 || st.PortClaims[0] != want[0] {
		t.Errorf("port claims %+v, want %+v", st.PortClaims, want)
	}
	if st.Limits.MaxConnections != 7 || st.Limits.ConnectionsActive != 0 || st.Limits.TunnelBudget <= 0 || st.Limits.MemoryLimit <= 0 {
		t.Errorf("limits %+v", st.Limits)
	}
}

// TestAdminListenerStopsWithRun: the listener closes when Run returns.
func TestAdminListenerStopsWithRun(t *testing.T) {
	cfg := testConfig("127.0.0.1:1", "t", Upstream{Host: "a.example.com", Target: "http://127.0.0.1:1"})
	cfg.AdminListen = "127.0.0.1:0"
	ag := startAgent(t, cfg)
	waitFor(t, 5*time.Second, "the admin listener", func() bool { return ag.AdminAddr() != nil })
	addr := ag.AdminAddr().String()
	if code, body := adminGet(t, ag.Agent, "/readyz"); code != 503 || !strings.HasPrefix(body, "not ready: no session with grpc://127.0.0.1:1") {
		t.Errorf("/readyz before any node: %d %q", code, body)
	}
	if err := ag.stop(t); err != nil {
		t.Fatal(err)
	}
	if ag.AdminAddr() != nil {
		t.Error("AdminAddr after Run returned")
	}
	if c, err := net.Dial("tcp", addr); err == nil {
		c.Close()
		t.Error("the admin listener still accepts after Run returned")
	}
}

// TestCollectorCountsUnknownRoutesApart: a route name the node sends that
// the configuration lacks is counted under one bounded label.
func TestCollectorCountsUnknownRoutesApart(t *testing.T) {
	c := newConnCounters(&Config{Upstreams: []Upstream{{Name: "web"}}})
	c.record(ConnReport{Route: "web", FromClient: 3, ToClient: 4, Outcome: ConnOK})
	c.record(ConnReport{Route: "web", Outcome: ConnLimit})
	c.record(ConnReport{Route: "node-made-up-1", Outcome: ConnUnknownRoute})
	c.record(ConnReport{Route: "node-made-up-2", Outcome: ConnUnknownRoute})
	if w := c.routes["web"]; w.fromClient.Load() != 3 || w.toClient.Load() != 4 || w.outcomes[ConnOK].Load() != 1 {
		t.Errorf("web counters wrong")
	}
	if n := c.unknown.outcomes[ConnUnknownRoute].Load(); n != 2 {
		t.Errorf("unknown routes %d, want 2", n)
	}
	if n := c.limitRejected(); n != 1 {
		t.Errorf("limit rejections %d, want 1", n)
	}
}

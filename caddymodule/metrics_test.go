package caddymodule

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// metricsNode is a node that reports under id, with no listener.
func metricsNode(t testing.TB, addr, id string) *node {
	t.Helper()
	n := newNode(addr, nil, zap.NewNop())
	t.Cleanup(n.drainNow)
	opts := *n.opts.Load()
	opts.nodeID, opts.maxSessions, opts.maxPending = id, 7, 3
	n.opts.Store(&opts)
	return n
}

// openSession registers a session of agent id on n whose agent end
// accepts every connection and keeps it open.
func openSession(t testing.TB, n *node, id, build string) *agentSession {
	t.Helper()
	nodeEnd, agentEnd := tunnelcore.Pipe(16)
	sess, err := tunnelcore.NewSession(nodeEnd, tunnelcore.Config{Role: tunnelcore.RoleNode, AcceptBacklog: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	peer, err := tunnelcore.NewSession(agentEnd, tunnelcore.Config{Role: tunnelcore.RoleAgent, AcceptBacklog: 1 << 16})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close(); peer.Close() })
	go func() {
		for {
			if _, err := peer.Accept(context.Background()); err != nil {
				return
			}
		}
	}()
	a := &agentSession{agentID: id, build: build, sess: sess}
	n.reg.register(a, nil)
	return a
}

// scrape gathers m through a pedantic registry (as Caddy's is) and returns
// each sample by `name{label="value",...}`, labels sorted.
func scrape(t testing.TB, m *metricsCollector) map[string]float64 {
	t.Helper()
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(m)
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatalf("gather: %v", err)
	}
	out := map[string]float64{}
	for _, mf := range mfs {
		for _, s := range mf.GetMetric() {
			var labels []string
			for _, l := range s.GetLabel() {
				labels = append(labels, fmt.Sprintf("%s=%q", l.GetName(), l.GetValue()))
			}
			slices.Sort(labels)
			v := s.GetGauge().GetValue() + s.GetCounter().GetValue()
			out[mf.GetName()+"{"+strings.Join(labels, ",")+"}"] = v
		}
	}
	return out
}

func collectorOf(nodes ...*node) *metricsCollector {
	return newMetricsCollector(func() []*node { return nodes })
}

// want fails unless got has each sample of want.
func want(t *testing.T, got map[string]float64, want map[string]float64) {
	t.Helper()
	for k, v := range want {
		if g, ok := got[k]; !ok || g != v {
			t.Errorf("%s = %v (present %v), want %v", k, g, ok, v)
		}
	}
}

// TestMetricsReadLiveState: sessions, connections open by route, the
// limits and the budget are read at scrape time, labelled with node_id.
func TestMetricsReadLiveState(t *testing.T) {
	n := metricsNode(t, "test", "node-1")
	a := openSession(t, n, "agent-a", "")
	openSession(t, n, "agent-b", "sluice-agent v1")
	for i, route := range []string{"app.test", "app.test", ":9000"} {
		if _, err := a.sess.Open(tunnelcore.ConnectInfo{RouteKey: route}); err != nil {
			t.Fatalf("open %d: %v", i, err)
		}
	}
	n.budget.SetLimit(1 << 20)
	n.slots.SetLimit(50)
	got := scrape(t, collectorOf(n))
	want(t, got, map[string]float64{
		`sluice_tunnel_sessions{node="node-1"}`:                                2,
		`sluice_tunnel_sessions_build_unknown{node="node-1"}`:                  1,
		`sluice_connections_active{node="node-1",route="app.test"}`:            2,
		`sluice_connections_active{node="node-1",route=":9000"}`:               1,
		`sluice_tunnel_budget_bytes{node="node-1"}`:                            1 << 20,
		`sluice_data_connections_limit{node="node-1"}`:                         50,
		`sluice_tunnel_sessions_limit{node="node-1"}`:                          7,
		`sluice_tunnel_streams_pending_limit{node="node-1"}`:                   3,
		`sluice_port_claims{node="node-1",state="bound"}`:                      0,
		`sluice_direct_sockets{node="node-1"}`:                                 0,
		`sluice_tunnel_sessions_lane{node="node-1"}`:                           0,
		`sluice_tunnel_streams_refused_total{node="node-1",reason="draining"}`: 0,
	})
}

// TestMetricsCountConnectionEnds: each ended connection the node opened
// adds its bytes and its kind and outcome under its route; those agents
// opened are not counted.
func TestMetricsCountConnectionEnds(t *testing.T) {
	n := metricsNode(t, "test", "node-1")
	c := &n.metrics
	c.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "app.test", Tag: new(httpConn)}, Read: 100, Written: 10})
	up := new(httpConn)
	up.upgraded.Store(true)
	c.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "app.test", Tag: up}, Read: 5, Written: 7, Outcome: tunnelcore.ConnPeerAborted})
	c.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "db"}, Read: 1, Written: 2, Outcome: tunnelcore.ConnSessionEnded})
	c.connEnded(tunnelcore.ConnEnd{OpenedHere: false, Info: tunnelcore.ConnectInfo{RouteKey: "db"}, Read: 1000})
	want(t, scrape(t, collectorOf(n)), map[string]float64{
		`sluice_tunnel_bytes_total{direction="to_client",node="node-1",route="app.test"}`:                      105,
		`sluice_tunnel_bytes_total{direction="to_agent",node="node-1",route="app.test"}`:                       17,
		`sluice_tunnel_bytes_total{direction="to_client",node="node-1",route="db"}`:                            1,
		`sluice_connections_total{kind="http",node="node-1",outcome="closed",route="app.test"}`:                1,
		`sluice_connections_total{kind="http_upgraded",node="node-1",outcome="peer_aborted",route="app.test"}`: 1,
		`sluice_connections_total{kind="tcp",node="node-1",outcome="session_ended",route="db"}`:                1,
	})
}

// TestMetricsCountRefusals: limits, stream refusals, rejected routes,
// credential failures, stalls and advertise timeouts each count under
// their bounded reason.
func TestMetricsCountRefusals(t *testing.T) {
	n := metricsNode(t, "test", "node-1")
	n.logLimit("http", agentConnLimit.String(), "192.0.2.1:1")
	n.logLimit("http", nodeConnLimit.String(), "192.0.2.1:1")
	n.logLimit("tcp", "max_connections_per_address", "192.0.2.1:1")
	n.logLimit("tcp", "something new", "192.0.2.1:1")
	opts := &nodeOptions{maxPending: 1, maxSessions: 1}
	rel, err := n.admitStream("192.0.2.1:1", opts)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := n.admitStream("192.0.2.1:2", opts); err == nil {
		t.Fatal("second pending stream admitted past max_pending_streams 1")
	}
	rel()
	relS, err := n.admitSession("192.0.2.1:1", agentKey{id: "a"}, nil, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer relS()
	if _, err := n.admitSession("192.0.2.1:1", agentKey{id: "b"}, nil, opts); err == nil {
		t.Fatal("second session admitted past max_sessions 1")
	}
	n.authFailures.Add(2)
	n.metrics.rejectRoutes(rejectPort, 3)
	want(t, scrape(t, collectorOf(n)), map[string]float64{
		`sluice_data_connections_rejected_total{node="node-1",reason="agent_max_connections"}`:       1,
		`sluice_data_connections_rejected_total{node="node-1",reason="max_connections"}`:             1,
		`sluice_data_connections_rejected_total{node="node-1",reason="max_connections_per_address"}`: 1,
		`sluice_data_connections_rejected_total{node="node-1",reason="other"}`:                       1,
		`sluice_tunnel_streams_refused_total{node="node-1",reason="max_pending_streams"}`:            1,
		`sluice_tunnel_streams_refused_total{node="node-1",reason="max_sessions"}`:                   1,
		`sluice_auth_failures_total{node="node-1"}`:                                                  2,
		`sluice_advertise_rejected_total{node="node-1",reason="port"}`:                               3,
	})
}

// TestMetricsRouteLabelsBounded: past maxRouteLabels distinct route names,
// routes report under otherRoute; a route named like it, or with a name
// that is no valid label value, joins it rather than duplicating a series.
func TestMetricsRouteLabelsBounded(t *testing.T) {
	n := metricsNode(t, "test", "node-1")
	for i := range maxRouteLabels + 5 {
		n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: fmt.Sprintf("r%d", i)}, Read: 1})
	}
	n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: otherRoute}, Read: 1})
	n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "bad\xff"}, Read: 1})
	n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "r0"}, Read: 1})
	got := scrape(t, collectorOf(n))
	routes := 0
	for k := range got {
		if strings.HasPrefix(k, "sluice_tunnel_bytes_total{") && strings.Contains(k, `direction="to_client"`) {
			routes++
		}
	}
	if routes != maxRouteLabels+1 {
		t.Errorf("%d route label values, want %d (the bound and %q)", routes, maxRouteLabels+1, otherRoute)
	}
	want(t, got, map[string]float64{
		`sluice_tunnel_bytes_total{direction="to_client",node="node-1",route="(other)"}`: 7,
		`sluice_tunnel_bytes_total{direction="to_client",node="node-1",route="r0"}`:      2,
	})
}

// TestMetricsNodesSharingAnID: two nodes of one process with one node id
// report under "<id>@<listen>" rather than failing the scrape.
func TestMetricsNodesSharingAnID(t *testing.T) {
	a, b := metricsNode(t, ":1", "same"), metricsNode(t, ":2", "same")
	other := metricsNode(t, ":3", "other")
	want(t, scrape(t, collectorOf(a, b, other)), map[string]float64{
		`sluice_tunnel_sessions{node="same@:1"}`: 0,
		`sluice_tunnel_sessions{node="same@:2"}`: 0,
		`sluice_tunnel_sessions{node="other"}`:   0,
	})
}

// TestMetricsRegisterEachConfig: every config's registry takes the
// collector; registering it twice into one is no error.
func TestMetricsRegisterEachConfig(t *testing.T) {
	for range 2 {
		reg := prometheus.NewPedanticRegistry()
		for range 2 {
			if err := registerMetrics(reg); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := reg.Gather(); err != nil {
			t.Fatal(err)
		}
	}
	if err := registerMetrics(nil); err != nil {
		t.Fatal(err)
	}
}

// TestMetricsLint: the metrics pass promlint.
func TestMetricsLint(t *testing.T) {
	n := metricsNode(t, "test", "node-1")
	a := openSession(t, n, "agent-a", "")
	if _, err := a.sess.Open(tunnelcore.ConnectInfo{RouteKey: "app.test"}); err != nil {
		t.Fatal(err)
	}
	n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: "app.test"}, Read: 1})
	reg := prometheus.NewPedanticRegistry()
	reg.MustRegister(collectorOf(n))
	problems, err := testutil.GatherAndLint(reg)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range problems {
		t.Errorf("promlint: %s: %s", p.Metric, p.Text)
	}
}

// BenchmarkMetricsCollect scrapes a node with 1,000 routes (each with
// ended connections of several kinds and outcomes) and 10,000 open
// connections over 10 sessions.
func BenchmarkMetricsCollect(b *testing.B) {
	n := metricsNode(b, "test", "node-1")
	const routes, conns, sessions = 1000, 10000, 10
	for r := range routes {
		name := fmt.Sprintf("route-%d.test", r)
		for o := range 3 {
			n.metrics.connEnded(tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: name, Tag: new(httpConn)},
				Read: 1000, Written: 100, Outcome: tunnelcore.ConnOutcome(o)})
		}
	}
	var ss []*agentSession
	for s := range sessions {
		ss = append(ss, openSession(b, n, fmt.Sprintf("agent-%d", s), ""))
	}
	for i := range conns {
		info := tunnelcore.ConnectInfo{RouteKey: fmt.Sprintf("route-%d.test", i%routes)}
		if _, err := ss[i%sessions].sess.Open(info); err != nil {
			b.Fatalf("open %d: %v", i, err)
		}
	}
	m := collectorOf(n)
	b.Run("Collect", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			ch := make(chan prometheus.Metric, 1024)
			go func() { m.Collect(ch); close(ch) }()
			for range ch {
			}
		}
	})
	// Gather is the whole scrape as Caddy's pedantic registry runs it.
	b.Run("Gather", func(b *testing.B) {
		reg := prometheus.NewPedanticRegistry()
		reg.MustRegister(m)
		b.ReportAllocs()
		for b.Loop() {
			if _, err := reg.Gather(); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// BenchmarkMetricsConnEnded is what the counters add to each connection's
// end: a map lookup and a few atomic adds.
func BenchmarkMetricsConnEnded(b *testing.B) {
	var c nodeCounters
	ends := make([]tunnelcore.ConnEnd, 1000)
	for i := range ends {
		ends[i] = tunnelcore.ConnEnd{OpenedHere: true, Info: tunnelcore.ConnectInfo{RouteKey: fmt.Sprintf("route-%d.test", i)}, Read: 100, Written: 10}
	}
	b.ReportAllocs()
	i := 0
	for b.Loop() {
		c.connEnded(ends[i%len(ends)])
		i++
	}
}

package caddymodule

import (
	"context"
	"fmt"
	"net"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"go.uber.org/zap"
	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestClusterConfigErrorsNameTheField: every cluster setting the node
// cannot use fails the load with an error naming its field.
func TestClusterConfigErrorsNameTheField(t *testing.T) {
	nodes := func(ns ...ClusterNode) *Cluster { return &Cluster{Nodes: ns} }
	tooMany := &Cluster{}
	for i := range maxClusterNodes {
		tooMany.Nodes = append(tooMany.Nodes, ClusterNode{ID: fmt.Sprintf("m%d", i), URL: fmt.Sprintf("grpc://10.0.0.1:%d", 9000+i)})
	}
	const tok = "cluster-test-token-0123456789abcdef"
	for _, tc := range []struct {
		name string
		app  App
		want string
	}{
		{"no node_id", App{Token: tok, Cluster: nodes()}, "sluice: node_id: required with cluster"},
		{"node_id with a space", App{Token: tok, NodeID: "n 1", Cluster: nodes()}, "sluice: node_id: "},
		{"no explicit token", App{NodeID: "n1", Cluster: nodes()}, "sluice: token: a cluster needs an explicit token"},
		{"empty id", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{URL: "grpc://h:1"})}, "sluice: cluster: nodes[0]: id: empty"},
		{"id with a space", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n 2", URL: "grpc://h:1"})}, "sluice: cluster: nodes[0]: id: "},
		{"id twice", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "grpc://h:1"}, ClusterNode{ID: "n2", URL: "grpc://h:2"})},
			`sluice: cluster: nodes[1]: id: "n2" is listed twice`},
		{"another node without url", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2"})}, "sluice: cluster: nodes[0] (n2): url: required"},
		{"http url", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "http://h:1"})}, "sluice: cluster: nodes[0] (n2): url: "},
		{"url without scheme", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "h:1"})}, "sluice: cluster: nodes[0] (n2): url: "},
		{"url without port", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "grpc://h"})}, "sluice: cluster: nodes[0] (n2): url: "},
		{"url with a path", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "grpcs://h:1/x"})}, "sluice: cluster: nodes[0] (n2): url: "},
		{"url with port 0", App{Token: tok, NodeID: "n1", Cluster: nodes(ClusterNode{ID: "n2", URL: "grpc://h:0"})}, "sluice: cluster: nodes[0] (n2): url: "},
		{"65 members with the local node", App{Token: tok, NodeID: "n1", Cluster: tooMany}, "sluice: cluster: nodes: 65 members"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.app.provisionCluster()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
	if err := (&App{Warmup: caddy.Duration(-time.Second)}).Validate(); err == nil || !strings.Contains(err.Error(), "warmup") {
		t.Errorf("a negative warmup: %v, want an error naming warmup", err)
	}
}

// TestClusterAcceptsEveryExplicitCredential: a token, a token file, named
// credentials or client_auth each let a cluster load; 64 members (the
// local node among them) are fine.
func TestClusterAcceptsEveryExplicitCredential(t *testing.T) {
	full := &Cluster{}
	for i := range maxClusterNodes {
		full.Nodes = append(full.Nodes, ClusterNode{ID: fmt.Sprintf("m%d", i), URL: fmt.Sprintf("grpc://10.0.0.1:%d", 9000+i)})
	}
	for _, a := range []App{
		{Token: "t", NodeID: "m0", Cluster: full},
		{TokenFile: "/nonexistent", NodeID: "n1", Cluster: &Cluster{}},
		{Credentials: []*Credential{{Name: "a", Token: "t"}}, NodeID: "n1", Cluster: &Cluster{}},
		{ClientAuth: &ClientAuth{}, NodeID: "n1", Cluster: &Cluster{}},
	} {
		if err := a.provisionCluster(); err != nil {
			t.Errorf("%+v: %v", a, err)
		}
	}
}

// TestClusterAddsTheLocalNode: a list that does not name node_id gets it
// with an empty url; one that does keeps its url; members are sorted by id
// whatever order the config gives.
func TestClusterAddsTheLocalNode(t *testing.T) {
	for _, tc := range []struct {
		nodes []ClusterNode
		want  string
	}{
		{[]ClusterNode{{ID: "n3", URL: "grpcs://n3.test:8001"}, {ID: "n2", URL: "grpc://127.0.0.1:9002"}},
			"n1=,n2=grpc://127.0.0.1:9002,n3=grpcs://n3.test:8001"},
		{[]ClusterNode{{ID: "n2", URL: "grpc://127.0.0.1:9002"}, {ID: "n1", URL: "grpc://127.0.0.1:9001"}},
			"n1=grpc://127.0.0.1:9001,n2=grpc://127.0.0.1:9002"},
		{[]ClusterNode{{ID: "n1"}}, "n1="},
		{nil, "n1="},
	} {
		a := App{Token: "t", NodeID: "n1", Cluster: &Cluster{Nodes: tc.nodes}}
		if err := a.provisionCluster(); err != nil {
			t.Fatal(err)
		}
		if got := nodesString(a.members.list("n1")); got != tc.want {
			t.Errorf("%v: members %s, want %s", tc.nodes, got, tc.want)
		}
	}
}

// TestClusterRefusedAtLoadWithoutCredentials: with cluster, a config
// without a token of the operator's (the node would generate one of its
// own) or without node_id does not load.
func TestClusterRefusedAtLoadWithoutCredentials(t *testing.T) {
	for _, tc := range []struct{ sluice, want string }{
		{`"listen": "127.0.0.1:0", "node_id": "n1", "cluster": {"nodes": [{"id": "n2", "url": "grpc://127.0.0.1:1"}]}`, "sluice: token: "},
		{`"listen": "127.0.0.1:0", "token": "cluster-test-token-0123456789abcdef", "cluster": {}`, "sluice: node_id: "},
	} {
		err := loadConfig(t, tc.sluice)
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("got %v, want an error containing %q", err, tc.want)
		}
	}
}

func nodesString(ns []*tunnelpb.Node) string {
	var parts []string
	for _, n := range ns {
		parts = append(parts, n.GetId()+"="+n.GetUrl())
	}
	return strings.Join(parts, ",")
}

// controlFrames is an agent's end of a session: it records the control
// frames the node sends, in order.
type controlFrames chan *tunnelpb.Frame

// next returns the next control frame the node sent, skipping none.
func (c controlFrames) next(t *testing.T) *tunnelpb.Frame {
	t.Helper()
	select {
	case f := <-c:
		return f
	case <-time.After(10 * time.Second):
		t.Fatal("no control frame from the node")
		return nil
	}
}

// registerAgent opens a session of agent id on n over an in-memory pipe
// and registers it as Connect's register stage does; it returns the
// session and the frames its agent receives.
func registerAgent(t *testing.T, n *node, id string) (*agentSession, controlFrames) {
	t.Helper()
	frames := make(controlFrames, 64)
	nodeEnd, agentEnd := tunnelcore.Pipe(64)
	sess, err := tunnelcore.NewSession(nodeEnd, tunnelcore.Config{Role: tunnelcore.RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	peer, err := tunnelcore.NewSession(agentEnd, tunnelcore.Config{Role: tunnelcore.RoleAgent, OnControl: func(f *tunnelpb.Frame) { frames <- f }})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })
	a := &agentSession{agentID: id, sess: sess, remote: "127.0.0.1:1"}
	a.advertised = []*tunnelpb.Route{{Name: id + ".test", Host: id + ".test", Target: "http://127.0.0.1:9"}}
	h := &handshake{n: n, a: a, remote: a.remote}
	n.admitMu.Lock()
	h.register()
	n.admitMu.Unlock()
	return a, frames
}

// withCluster gives n's options the members of a cluster config naming
// nodes, with node_id local.
func withCluster(t *testing.T, n *node, local string, nodes ...ClusterNode) {
	t.Helper()
	m, err := (&Cluster{Nodes: nodes}).membership(local)
	if err != nil {
		t.Fatal(err)
	}
	opts := *n.opts.Load()
	opts.nodeID, opts.cluster = local, m
	n.opts.Store(&opts)
}

// wantMembership fails t unless f is a MembershipUpdate of want.
func wantMembership(t *testing.T, f *tunnelpb.Frame, want string) {
	t.Helper()
	mu := f.GetMembershipUpdate()
	if mu == nil {
		t.Fatalf("got %v, want a MembershipUpdate of %s", f, want)
	}
	if got := nodesString(mu.GetNodes()); got != want {
		t.Fatalf("MembershipUpdate of %s, want %s", got, want)
	}
}

// TestMembershipFollowsTheAck: in a cluster, a registered session gets
// its AdvertiseAck (naming the node by its node_id) and then the members;
// without a cluster, nothing but the ack (the next frame is the one sent
// after it).
func TestMembershipFollowsTheAck(t *testing.T) {
	n := testNode(t)
	withCluster(t, n, "n1", ClusterNode{ID: "n2", URL: "grpc://127.0.0.1:9002"})
	_, frames := registerAgent(t, n, "agent-a")
	ack := frames.next(t).GetAdvertiseAck()
	if ack == nil || ack.GetNodeId() != "n1" || len(ack.GetAccepted()) != 1 {
		t.Fatalf("first frame's ack %v, want one accepting the route from node n1", ack)
	}
	wantMembership(t, frames.next(t), "n1=,n2=grpc://127.0.0.1:9002")
	if got := nodesString(n.members()); got != "n1=,n2=grpc://127.0.0.1:9002" {
		t.Errorf("ListNodes answers %s", got)
	}

	alone := testNode(t)
	opts := *alone.opts.Load()
	opts.nodeID = "solo"
	alone.opts.Store(&opts)
	a, frames := registerAgent(t, alone, "agent-a")
	if ack := frames.next(t).GetAdvertiseAck(); ack == nil || ack.GetNodeId() != "solo@"+alone.id {
		t.Fatalf("standalone ack %v, want one naming node_id and the listener solo@%s", ack, alone.id)
	}
	alone.pushMembership() // a reload without a cluster: nothing to tell
	alone.admitMu.Lock()
	alone.sendAck(a, nil) // a marker: the frame after the first ack
	alone.admitMu.Unlock()
	if f := frames.next(t); f.GetAdvertiseAck() == nil {
		t.Fatalf("standalone node sent %v after the ack, want nothing before the next ack", f)
	}
	if got := nodesString(alone.members()); got != "solo=" {
		t.Errorf("standalone ListNodes answers %s, want the node alone", got)
	}
}

// clusterApp is an App of a config whose cluster names nodes, on n.
func clusterApp(n *node, nodes ...ClusterNode) *App {
	a := &App{NodeID: "n1", Token: "t", node: n, logger: zap.NewNop(), MaxSessions: DefaultMaxSessions, DrainGrace: caddy.Duration(time.Second),
		Cluster: &Cluster{Nodes: nodes}}
	if err := a.provisionCluster(); err != nil {
		panic(err)
	}
	a.listen = func() (net.Listener, error) { panic("the test node serves already") }
	return a
}

// pooledNode puts n into nodePool under a key of its own, held twice, as
// it is while one config takes over from another (App.Stop tells a
// reload from a shutdown by the references).
func pooledNode(t *testing.T, n *node) {
	t.Helper()
	n.addr = "cluster-test/" + t.Name()
	for range 2 {
		if _, _, err := nodePool.LoadOrNew(nodeKey(n.addr), func() (caddy.Destructor, error) { return n, nil }); err != nil {
			t.Fatal(err)
		}
	}
	t.Cleanup(func() {
		for range 2 {
			nodePool.Delete(nodeKey(n.addr))
		}
	})
}

// TestMembershipPushedOnReload: a reload that changes the members tells
// every session once its config took over; one that does not tells
// nothing; a start rolled back tells the sessions that registered under
// it the members they are back to.
func TestMembershipPushedOnReload(t *testing.T) {
	n := testNode(t)
	pooledNode(t, n)
	n2 := ClusterNode{ID: "n2", URL: "grpc://127.0.0.1:9002"}
	n3 := ClusterNode{ID: "n3", URL: "grpcs://127.0.0.1:9003"}
	start := func(a *App) {
		t.Helper()
		if err := a.Start(); err != nil {
			t.Fatal(err)
		}
	}
	stop := func(a *App) {
		t.Helper()
		if err := a.Stop(); err != nil {
			t.Fatal(err)
		}
	}

	first := clusterApp(n, n2)
	start(first)
	_, frames := registerAgent(t, n, "agent-a")
	frames.next(t) // the ack
	wantMembership(t, frames.next(t), "n1=,n2=grpc://127.0.0.1:9002")

	// The same members: nothing is sent.
	same := clusterApp(n, n2)
	same.DrainGrace = caddy.Duration(2 * time.Second)
	start(same)
	stop(first)

	// A start rolled back: the session registered under it learnt its
	// members with its ack and is told the previous ones; the first
	// session, which never heard of them, is told nothing.
	rolledBack := clusterApp(n, n2, n3)
	start(rolledBack)
	_, during := registerAgent(t, n, "agent-b")
	during.next(t)
	wantMembership(t, during.next(t), "n1=,n2=grpc://127.0.0.1:9002,n3=grpcs://127.0.0.1:9003")
	stop(rolledBack)
	wantMembership(t, during.next(t), "n1=,n2=grpc://127.0.0.1:9002")

	// A reload that changes them: both are told, once it took over.
	changed := clusterApp(n, n3)
	start(changed)
	stop(same)
	wantMembership(t, frames.next(t), "n1=,n3=grpcs://127.0.0.1:9003")
	wantMembership(t, during.next(t), "n1=,n3=grpcs://127.0.0.1:9003")

	// Without the cluster: the sessions told of one learn the node is
	// alone.
	alone := &App{NodeID: "n1", node: n, logger: zap.NewNop(), MaxSessions: DefaultMaxSessions, DrainGrace: caddy.Duration(time.Second)}
	start(alone)
	stop(changed)
	// As its acks name it from now on: the agent finds the sender listed.
	wantMembership(t, frames.next(t), "n1@"+n.id+"=")
}

// TestWarmupKeepsReadinessDown: readiness is down ("warming up") for
// warmup after the listener started serving, ready once it passed (a
// comparison of times, no timer), and a second serve (a reload's Start)
// does not start it again.
func TestWarmupKeepsReadinessDown(t *testing.T) {
	n := testNode(t)
	if ready, reason := n.readiness(); !ready {
		t.Fatalf("without warmup: not ready (%s)", reason)
	}
	opts := *n.opts.Load()
	opts.warmup = time.Hour
	n.opts.Store(&opts)
	if ready, reason := n.readiness(); ready || reason != reasonWarmingUp {
		t.Fatalf("readiness %v %q during the warm-up, want down with %q", ready, reason, reasonWarmingUp)
	}
	st := n.status()
	if !st.WarmingUp || st.Warmup != "1h0m0s" || st.WarmupEnds.Before(time.Now().Add(59*time.Minute)) || st.ServingSince.IsZero() {
		t.Fatalf("status during the warm-up: warming_up %v, warmup %q, ends %v, serving since %v", st.WarmingUp, st.Warmup, st.WarmupEnds, st.ServingSince)
	}

	since := n.servingSince()
	if err := n.serve(func() (net.Listener, error) { panic("serving already") }); err != nil {
		t.Fatal(err)
	}
	if n.servingSince() != since {
		t.Fatal("a second serve moved the start of the warm-up")
	}

	n.serveMu.Lock()
	n.started = n.started.Add(-time.Hour) // as if the hour had passed
	n.serveMu.Unlock()
	if ready, reason := n.readiness(); !ready {
		t.Fatalf("after the warm-up: not ready (%s)", reason)
	}
	if st := n.status(); st.WarmingUp {
		t.Fatal("status still warming up after it")
	}
	n.draining.Store(true)
	if ready, reason := n.readiness(); ready || reason != reasonDraining {
		t.Fatalf("draining: %v %q", ready, reason)
	}
}

// TestWarmupLeft: the warm-up arithmetic, at its edges.
func TestWarmupLeft(t *testing.T) {
	t0 := time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)
	for _, tc := range []struct {
		started time.Time
		warmup  time.Duration
		now     time.Time
		want    time.Duration
	}{
		{t0, 0, t0, 0},
		{time.Time{}, time.Second, t0, 0},
		{t0, 2 * time.Second, t0, 2 * time.Second},
		{t0, 2 * time.Second, t0.Add(1500 * time.Millisecond), 500 * time.Millisecond},
		{t0, 2 * time.Second, t0.Add(2 * time.Second), 0},
		{t0, 2 * time.Second, t0.Add(time.Hour), 0},
	} {
		if got := warmupLeft(tc.started, tc.warmup, tc.now); got != tc.want {
			t.Errorf("warmupLeft(%v, %v, %v) = %v, want %v", tc.started, tc.warmup, tc.now, got, tc.want)
		}
	}
}

// TestStatusShowsTheMembers: /sluice/status lists the members, this node
// marked.
func TestStatusShowsTheMembers(t *testing.T) {
	n := testNode(t)
	if st := n.status(); st.Members != nil || st.WarmingUp || st.Warmup != "" {
		t.Fatalf("standalone status: members %v, warming_up %v, warmup %q", st.Members, st.WarmingUp, st.Warmup)
	}
	withCluster(t, n, "n2", ClusterNode{ID: "n1", URL: "grpc://127.0.0.1:9001"})
	st := n.status()
	want := []MemberStatus{{ID: "n1", URL: "grpc://127.0.0.1:9001"}, {ID: "n2", Local: true}}
	if fmt.Sprint(st.Members) != fmt.Sprint(want) {
		t.Fatalf("members %+v, want %+v", st.Members, want)
	}
}

// TestMembershipOverGRPCAcrossReloads: through Caddy's own reloads and a
// real agent stream, the members follow the AdvertiseAck, a reload that
// keeps them sends nothing, one that changes them sends them, and
// ListNodes answers with them.
func TestMembershipOverGRPCAcrossReloads(t *testing.T) {
	const tok = "cluster-test-token-0123456789abcdef"
	cfg := func(extra string, nodes ...string) string {
		return `"listen": "127.0.0.1:0", "token": "` + tok + `", "node_id": "n1"` + extra +
			`, "cluster": {"nodes": [` + strings.Join(nodes, ",") + `]}`
	}
	n2, n3 := `{"id": "n2", "url": "grpc://127.0.0.1:9002"}`, `{"id": "n3", "url": "grpcs://127.0.0.1:9003"}`
	if err := loadConfig(t, cfg("", n2)); err != nil {
		t.Fatal(err)
	}
	app, err := runningApp()
	if err != nil {
		t.Fatal(err)
	}
	cc := controlClient(t, app.node)
	st, err := connectStream(t, cc, tok)
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: "agent-a", InitialWindow: tunnelcore.InitialWindow, Routes: []*tunnelpb.Route{{Host: "app.test"}},
	}}}); err != nil {
		t.Fatal(err)
	}
	recv := func() *tunnelpb.Frame {
		t.Helper()
		f, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		return f
	}
	if ack := recv().GetAdvertiseAck(); ack == nil || ack.GetNodeId() != "n1" {
		t.Fatalf("first frame %v, want the AdvertiseAck of n1", ack)
	}
	wantMembership(t, recv(), "n1=,n2=grpc://127.0.0.1:9002")

	if err := loadConfig(t, cfg(`, "drain_grace": "3s"`, n2)); err != nil {
		t.Fatal(err)
	}
	if err := loadConfig(t, cfg("", n3, `{"id": "n1", "url": "grpc://127.0.0.1:9001"}`)); err != nil {
		t.Fatal(err)
	}
	want := "n1=grpc://127.0.0.1:9001,n3=grpcs://127.0.0.1:9003"
	wantMembership(t, recv(), want) // not the unchanged list first
	ctx := metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+tok)
	list, err := tunnelpb.NewTunnelClient(cc).ListNodes(ctx, &tunnelpb.ListNodesRequest{})
	if err != nil || nodesString(list.GetNodes()) != want {
		t.Fatalf("ListNodes: %v %v, want %s", list, err, want)
	}
}

// TestClusterCaddyfileErrors: a malformed cluster block fails at adapt
// time, naming what is wrong.
func TestClusterCaddyfileErrors(t *testing.T) {
	for _, tc := range []struct{ name, block, want string }{
		{"arguments", "cluster n1 {\n}", "sluice: cluster: takes no arguments"},
		{"other option", "cluster {\n\t\t\tnodes n1\n\t\t}", `sluice: cluster: unrecognized option "nodes"`},
		{"node without id", "cluster {\n\t\t\tnode\n\t\t}", "sluice: cluster: node: want <id> <url>"},
		{"node with three values", "cluster {\n\t\t\tnode n1 grpc://h:1 x\n\t\t}", "sluice: cluster: node: want <id> <url>"},
		{"warmup", "warmup soon", "sluice: warmup: "},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := "{\n\tsluice {\n\t\t" + tc.block + "\n\t}\n}\n:80\n"
			_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want an error containing %q", err, tc.want)
			}
		})
	}
}

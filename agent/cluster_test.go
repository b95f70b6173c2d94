package agent

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/netip"
	"regexp"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// memberOf is n as a member of a membership, with its URL.
func memberOf(n *fakeNode) *tunnelpb.Node { return &tunnelpb.Node{Id: n.id, Url: "grpc://" + n.addr} }

// self is the entry a node gives itself in its membership: no URL.
func self(n *fakeNode) *tunnelpb.Node { return &tunnelpb.Node{Id: n.id} }

// sendMembership sends a MembershipUpdate of nodes on ns.
func sendMembership(t testing.TB, ns *nodeSession, nodes ...*tunnelpb.Node) {
	t.Helper()
	err := ns.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_MembershipUpdate{MembershipUpdate: &tunnelpb.MembershipUpdate{Nodes: nodes}}})
	if err != nil {
		t.Fatal(err)
	}
}

// linkSummary is the agent's links as sorted "node:state" words.
func linkSummary(a *Agent) string {
	var words []string
	for _, l := range a.Links() {
		words = append(words, l.NodeID+":"+l.State.String())
	}
	slices.Sort(words)
	return strings.Join(words, " ")
}

// waitLinks waits until the agent's links are want (linkSummary's form).
func waitLinks(t testing.TB, a *Agent, want string) {
	t.Helper()
	waitFor(t, 10*time.Second, "links "+want, func() bool { return linkSummary(a) == want })
}

// awaitDrain waits for the agent's Drain on ns.
func awaitDrain(t testing.TB, ns *nodeSession, what string) *tunnelpb.Drain {
	t.Helper()
	select {
	case d := <-ns.drains:
		return d
	case <-time.After(10 * time.Second):
		t.Fatalf("no Drain from the agent: %s", what)
		return nil
	}
}

// awaitEnd waits until ns ended.
func awaitEnd(t testing.TB, ns *nodeSession, what string) {
	t.Helper()
	select {
	case <-ns.sess.Done():
	case <-time.After(10 * time.Second):
		t.Fatalf("session still open: %s", what)
	}
}

func echoConfig(t testing.TB, addr string) *Config {
	return testConfig(addr, "secret", Upstream{Name: "echo", Target: "tcp://" + echoUpstream(t)})
}

// TestMembershipOpensAndClosesLinks: the agent bootstraps with its
// server, opens a link to every member the node names, serves on each,
// and leaves a member the membership no longer lists (its node sees a
// Drain). The sender's own entry, without a URL, is the link it came on.
func TestMembershipOpensAndClosesLinks(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	b := newFakeNode(t, "secret", nodeOptions{id: "node-b"})
	c := newFakeNode(t, "secret", nodeOptions{id: "node-c"})
	ag := startAgent(t, echoConfig(t, a.addr))
	nsA := a.next(t)
	waitLinks(t, ag.Agent, "node-a:connected")

	sendMembership(t, nsA, self(a), memberOf(b))
	nsB := b.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected")
	if links := ag.Links(); links[0].URL != "grpc://"+a.addr || links[0].Origin != "server" || links[1].Origin != "membership" {
		t.Errorf("links %+v: want the server's first, dialing a's address", links)
	}
	if n := a.attempts.Load(); n != 1 {
		t.Errorf("%d sessions with node-a, want 1: the sender's entry is the link it came on", n)
	}
	if !hasLog(ag.logs, "cluster membership", "from_node", "node-a") {
		t.Error("no cluster membership line")
	}

	sendMembership(t, nsA, self(a), memberOf(b), memberOf(c))
	nsC := c.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected node-c:connected")
	for _, ns := range []*nodeSession{nsA, nsB, nsC} {
		relayEcho(t, ns.sess, "through every node")
	}
	if ag.Sessions() != 3 || ag.NodeID() != "node-a" {
		t.Errorf("sessions %d, node id %q", ag.Sessions(), ag.NodeID())
	}

	sendMembership(t, nsA, self(a), memberOf(c))
	if d := awaitDrain(t, nsB, "the member removed"); !strings.Contains(d.GetReason(), "membership") {
		t.Errorf("Drain %v: want the reason to name the membership", d)
	}
	awaitEnd(t, nsB, "the member removed")
	waitLinks(t, ag.Agent, "node-a:connected node-c:connected")
	if n := b.attempts.Load(); n != 1 {
		t.Errorf("%d sessions with the removed node-b, want 1", n)
	}
	relayEcho(t, nsC.sess, "still served")
}

// TestMemberWithoutURLIsSkipped: a member other than the sender without a
// URL, or with a URL that is not usable, gets no link, and each problem is
// logged once however often the node repeats it.
func TestMemberWithoutURLIsSkipped(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	ag := startAgent(t, echoConfig(t, a.addr))
	nsA := a.next(t)
	for range 3 {
		sendMembership(t, nsA, self(a), &tunnelpb.Node{Id: "node-x"}, &tunnelpb.Node{Id: "node-y", Url: "grpcs://127.0.0.1:1"},
			&tunnelpb.Node{Id: "node-z", Url: "http://127.0.0.1:1"}, &tunnelpb.Node{Id: "bad id", Url: "grpc://127.0.0.1:1"})
	}
	waitFor(t, 10*time.Second, "the problems logged", func() bool {
		return ag.logs.FilterMessage("membership: a member's url is not usable").Len() >= 2 &&
			hasLog(ag.logs, "membership: no URL known for a member", "member", "node-x")
	})
	// One more update, that the agent applies after the others: by then
	// every problem was logged.
	sendMembership(t, nsA, self(a))
	waitFor(t, 10*time.Second, "the last membership", func() bool { return ag.logs.FilterMessage("cluster membership").Len() >= 2 })
	if n := ag.logs.FilterMessage("membership: a member's url is not usable").Len(); n != 2 {
		t.Errorf("%d lines for the unusable URLs, want one each (2)", n)
	}
	if n := ag.logs.FilterMessageSnippet("membership: no URL known for a member").Len(); n != 3 {
		t.Errorf("%d lines for members without a URL, want one each (3: two unusable URLs and none)", n)
	}
	if n := ag.logs.FilterMessage("membership: a member's id is not usable; member skipped").Len(); n != 1 {
		t.Errorf("%d lines for the bad id, want 1", n)
	}
	waitLinks(t, ag.Agent, "node-a:connected")
}

// TestBootstrapLinkSwitchesToMemberURL: an agent bootstrapped through a
// load balancer's address reconnects to the URL the membership gives its
// node, not through the balancer again (which could lead it to another
// node it has a session with already).
func TestBootstrapLinkSwitchesToMemberURL(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	lb, accepted := forwarder(t, a.addr)
	ag := startAgent(t, echoConfig(t, lb))
	nsA := a.next(t)
	sendMembership(t, nsA, memberOf(a))
	waitFor(t, 10*time.Second, "the switch to a's URL", func() bool { return ag.Links()[0].URL == "grpc://"+a.addr })
	nsA.cancel() // the node restarts, say
	a.next(t)
	waitLinks(t, ag.Agent, "node-a:connected")
	if n := accepted.Load(); n != 1 {
		t.Errorf("the load balancer saw %d connections, want the first alone", n)
	}
	if st := ag.Status().Sessions[0]; st.Server != "grpc://"+lb || st.URL != "grpc://"+a.addr || st.Origin != "server" {
		t.Errorf("session %+v: want server the balancer, url the node's", st)
	}
}

// TestServerLinkFindsAMovedCluster: when every node was replaced at once
// (new addresses, new ids), the server's link, which dialed its node's
// URL, tries the server setting again, and the agent takes the
// membership of the node it finds there, though no member named it.
func TestServerLinkFindsAMovedCluster(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	var lbTarget atomic.Pointer[string]
	lbTarget.Store(&a.addr)
	lb, accepted := forwarderTo(t, func() string { return *lbTarget.Load() })
	ag := startAgent(t, echoConfig(t, lb))
	nsA := a.next(t)
	sendMembership(t, nsA, memberOf(a))
	waitFor(t, 10*time.Second, "the switch to a's URL", func() bool { return ag.Links()[0].URL == "grpc://"+a.addr })

	var b *fakeNode
	b = newFakeNode(t, "secret", nodeOptions{id: "node-b",
		membership: func() *tunnelpb.MembershipUpdate {
			return &tunnelpb.MembershipUpdate{Nodes: []*tunnelpb.Node{memberOf(b)}}
		}})
	lbTarget.Store(&b.addr)
	a.stop() // the old cluster is gone; its URL answers no more
	b.next(t)
	waitFor(t, 10*time.Second, "node-b's URL taken", func() bool {
		l := ag.Links()
		return len(l) == 1 && l[0].NodeID == "node-b" && l[0].URL == "grpc://"+b.addr && l[0].State == StateConnected
	})
	if n := accepted.Load(); n < 2 {
		t.Errorf("the server setting saw %d connections: the agent did not dial it again", n)
	}
	if !hasLog(ag.logs, "cluster membership", "from_node", "node-b") {
		t.Error("the membership of node-b, found through the server setting, was not taken")
	}
}

// forwarder relays TCP connections to target; accepted counts them.
func forwarder(t testing.TB, target string) (addr string, accepted *atomic.Int32) {
	t.Helper()
	return forwarderTo(t, func() string { return target })
}

// forwarderTo relays each TCP connection to the address target returns
// when it comes; accepted counts them.
func forwarderTo(t testing.TB, target func() string) (addr string, accepted *atomic.Int32) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	accepted = new(atomic.Int32)
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			accepted.Add(1)
			to := target()
			wg.Go(func() { relayTo(c, to) })
		}
	})
	return ln.Addr().String(), accepted
}

// relayTo relays c to target until either side ends.
func relayTo(c net.Conn, target string) {
	defer c.Close()
	u, err := net.Dial("tcp", target)
	if err != nil {
		return
	}
	defer u.Close()
	done := make(chan struct{})
	go func() {
		io.Copy(u, c)
		u.Close()
		close(done)
	}()
	io.Copy(c, u)
	c.Close()
	<-done
}

// TestDrainOnOneLinkLeavesTheOthers: a node draining its session makes
// that link alone wait and reconnect; the agent stays ready through the
// other node.
func TestDrainOnOneLinkLeavesTheOthers(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	b := newFakeNode(t, "secret", nodeOptions{id: "node-b"})
	ag := startAgent(t, echoConfig(t, a.addr))
	nsA := a.next(t)
	sendMembership(t, nsA, self(a), memberOf(b))
	nsB := b.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected")

	if err := nsB.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{GraceMs: 60000, Reason: "test"}}}); err != nil {
		t.Fatal(err)
	}
	waitLinks(t, ag.Agent, "node-a:connected node-b:draining")
	if ready, reason := ag.Ready(); !ready || ag.State() != StateConnected {
		t.Errorf("ready %v (%s), state %v: node-a still serves", ready, reason, ag.State())
	}
	if st := ag.Status(); !st.Sessions[1].Draining || st.Sessions[0].Draining {
		t.Errorf("sessions %+v: want node-b's alone draining", st.Sessions)
	}
	relayEcho(t, nsA.sess, "a serves on")
	nsB.cancel() // the node ends the drained session
	b.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected")
	if n := a.attempts.Load(); n != 1 {
		t.Errorf("node-a saw %d sessions, want 1", n)
	}
	relayEcho(t, nsA.sess, "still the first session")
}

// TestMembershipRule: an update from a node that is not a member (here
// one whose URL the membership gives another member's id), or that does
// not list the node that sent it, changes nothing; the next update from a
// member does.
func TestMembershipRule(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	x := newFakeNode(t, "secret", nodeOptions{id: "node-x"})
	c := newFakeNode(t, "secret", nodeOptions{id: "node-c"})
	ag := startAgent(t, echoConfig(t, a.addr))
	nsA := a.next(t)
	// node-b's URL leads to node-x, which is no member.
	sendMembership(t, nsA, self(a), &tunnelpb.Node{Id: "node-b", Url: "grpc://" + x.addr})
	nsX := x.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-x:connected")
	if !hasLog(ag.logs, "the node at this member's URL has another id than the membership gives it", "member", "node-b") {
		t.Error("no warning about the member's URL leading to another node")
	}

	sendMembership(t, nsX, self(x), memberOf(c)) // from no member: ignored
	sendMembership(t, nsA, memberOf(c))          // does not list its sender: ignored
	waitFor(t, 10*time.Second, "both updates ignored", func() bool {
		return hasLog(ag.logs, "membership update ignored: it does not list the node that sent it", "from_node", "node-a") &&
			hasLog(ag.logs, "membership update from a node that is not a member ignored", "from_node", "node-x")
	})
	if n := c.attempts.Load(); n != 0 {
		t.Fatalf("node-c saw %d attempts; no member asked for it", n)
	}

	sendMembership(t, nsA, self(a), memberOf(c)) // from a member: node-b leaves, node-c joins
	c.next(t)
	awaitDrain(t, nsX, "node-b left the membership")
	waitLinks(t, ag.Agent, "node-a:connected node-c:connected")
}

// TestLinksAreBounded: a membership of more than maxLinks members gets
// maxLinks links, and says so once.
func TestLinksAreBounded(t *testing.T) {
	nodes := []member{{id: "self"}}
	for i := range maxLinks + 10 {
		nodes = append(nodes, member{id: "n" + string(rune('A'+i%26)) + strings.Repeat("x", i/26), url: "grpc://127.0.0.1:1"})
	}
	m, problems := parseMembership("self", nodes, nil, false)
	if m == nil || len(m.ids) != maxLinks || len(problems) != 1 || !strings.Contains(problems[0].msg, "more than 64") {
		t.Fatalf("membership %v, problems %v", m, problems)
	}
	if m.urls["self"] != "" || m.urls["nA"] != "grpc://127.0.0.1:1" {
		t.Errorf("urls %v", m.urls)
	}
}

// TestCheckMemberURL: a member's URL is grpc:// or grpcs:// with
// host:port, with the server's TLS-ness.
func TestCheckMemberURL(t *testing.T) {
	for _, tc := range []struct {
		raw     string
		tls     bool
		want    string
		wantErr string
	}{
		{"", false, "", ""},
		{"grpc://Node-2.example:8001", false, "grpc://node-2.example:8001", ""},
		{"grpcs://[::1]:8001/", true, "grpcs://[::1]:8001", ""},
		{"grpcs://node:8001", false, "", "every node is reached with the same TLS-ness"},
		{"grpc://node:8001", true, "", "every node is reached with the same TLS-ness"},
		{"grpc://node", false, "", "port required"},
		{"node:8001", false, "", "no scheme"},
		{"https://node:8001", false, "", "not supported"},
	} {
		got, err := checkMemberURL(tc.raw, tc.tls)
		if got != tc.want || (err == nil) != (tc.wantErr == "") || err != nil && !strings.Contains(err.Error(), tc.wantErr) {
			t.Errorf("checkMemberURL(%q, %v) = %q, %v; want %q, %q", tc.raw, tc.tls, got, err, tc.want, tc.wantErr)
		}
	}
}

// sharedPortListeners listens on the same port of 127.0.0.1, 127.0.0.2,
// ... (n addresses; all loopback on Linux), as nodes behind one DNS name
// that resolves to several addresses do.
func sharedPortListeners(t testing.TB, n int) []net.Listener {
	t.Helper()
	for range 20 { // a port free on the first address may be taken on another
		first, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		_, port, _ := net.SplitHostPort(first.Addr().String())
		lns := []net.Listener{first}
		for i := 2; i <= n; i++ {
			ln, err := net.Listen("tcp", net.JoinHostPort(netip.AddrFrom4([4]byte{127, 0, 0, byte(i)}).String(), port))
			if err != nil {
				break
			}
			lns = append(lns, ln)
		}
		if len(lns) == n {
			return lns
		}
		for _, ln := range lns {
			ln.Close()
		}
	}
	t.Skip("no port free on every loopback address")
	return nil
}

// fakeResolver answers with the addresses last set.
type fakeResolver struct {
	addrs atomic.Pointer[[]netip.Addr]
	calls atomic.Int32
}

func (r *fakeResolver) set(ips ...string) {
	addrs := make([]netip.Addr, 0, len(ips))
	for _, ip := range ips {
		addrs = append(addrs, netip.MustParseAddr(ip))
	}
	r.addrs.Store(&addrs)
}

func (r *fakeResolver) resolve(_ context.Context, network, host string) ([]netip.Addr, error) {
	r.calls.Add(1)
	if network != "ip" || host != "nodes.test" {
		return nil, &net.DNSError{Err: "no such host", Name: host, IsNotFound: true}
	}
	return *r.addrs.Load(), nil
}

// dnsAgent runs an agent with server_each_address for nodes.test at port
// with the fake resolver r, refreshing every 10 ms.
func dnsAgent(t testing.TB, port string, r *fakeResolver) *runningAgent {
	t.Helper()
	cfg := echoConfig(t, "nodes.test:"+port)
	cfg.ServerEachAddress = true
	return startAgent(t, cfg, func(a *Agent) { a.resolve, a.serverRefresh = r.resolve, 10*time.Millisecond })
}

// TestServerEachAddress: the agent keeps a link per address of the
// server's name as it resolves: two, then three, then one; the nodes of
// the addresses gone see a Drain. The nodes' membership is not used.
func TestServerEachAddress(t *testing.T) {
	lns := sharedPortListeners(t, 3)
	var nodes []*fakeNode
	for i, ln := range lns {
		nodes = append(nodes, newFakeNode(t, "secret", nodeOptions{lis: ln, id: "node-" + string(rune('1'+i))}))
	}
	_, port, _ := net.SplitHostPort(nodes[0].addr)
	r := new(fakeResolver)
	r.set("127.0.0.2", "127.0.0.1")
	ag := dnsAgent(t, port, r)
	ns1, ns2 := nodes[0].next(t), nodes[1].next(t)
	waitLinks(t, ag.Agent, "node-1:connected node-2:connected")
	if links := ag.Links(); links[0].URL != "grpc://127.0.0.1:"+port || links[0].Origin != "dns" {
		t.Errorf("links %+v: want one per address, in address order", links)
	}
	if a := ns1.md.Get(":authority"); len(a) != 1 || a[0] != "nodes.test:"+port {
		t.Errorf(":authority %v, want the server's name", a)
	}
	sendMembership(t, ns1, self(nodes[0]), &tunnelpb.Node{Id: "node-9", Url: "grpc://127.0.0.9:" + port})
	waitFor(t, 10*time.Second, "the membership logged", func() bool {
		return hasLog(ag.logs, "membership update not used", "from_node", "node-1")
	})

	r.set("127.0.0.1", "127.0.0.2", "127.0.0.3")
	ns3 := nodes[2].next(t)
	waitLinks(t, ag.Agent, "node-1:connected node-2:connected node-3:connected")

	r.set("127.0.0.2")
	awaitDrain(t, ns1, "127.0.0.1 no longer resolved")
	awaitDrain(t, ns3, "127.0.0.3 no longer resolved")
	waitLinks(t, ag.Agent, "node-2:connected")
	relayEcho(t, ns2.sess, "the one left serves")
	for i, n := range nodes {
		if got := n.attempts.Load(); got != 1 {
			t.Errorf("node-%d saw %d attempts, want 1", i+1, got)
		}
	}
}

// TestServerEachAddressKeepsLinksWhenResolvingFails: a failed resolve
// keeps the links, and is logged once per distinct error.
func TestServerEachAddressKeepsLinksWhenResolvingFails(t *testing.T) {
	node := newFakeNode(t, "secret", nodeOptions{})
	_, port, _ := net.SplitHostPort(node.addr)
	r := new(fakeResolver)
	r.set("127.0.0.1")
	ag := dnsAgent(t, port, r)
	node.next(t)
	waitLinks(t, ag.Agent, "node-1:connected")
	r.set() // resolves to nothing
	calls := r.calls.Load()
	waitFor(t, 10*time.Second, "a few failed resolves", func() bool { return r.calls.Load() > calls+5 })
	if n := ag.logs.FilterMessage("cannot resolve the server's name; keeping the sessions with the addresses resolved before").Len(); n != 1 {
		t.Errorf("%d resolve failure lines, want 1", n)
	}
	if linkSummary(ag.Agent) != "node-1:connected" {
		t.Errorf("links %s after failed resolves", linkSummary(ag.Agent))
	}
}

// TestAddressesOfOneNodeStandBy: two addresses that reach one node (its
// IPv4 and IPv6 address, say) make one session; the other link stands by
// instead of displacing it, and takes over once its address is gone.
func TestAddressesOfOneNodeStandBy(t *testing.T) {
	lns := sharedPortListeners(t, 2)
	first := newFakeNode(t, "secret", nodeOptions{lis: lns[0], id: "node-x"})
	second := newFakeNode(t, "secret", nodeOptions{lis: lns[1], id: "node-x"})
	_, port, _ := net.SplitHostPort(first.addr)
	r := new(fakeResolver)
	r.set("127.0.0.1", "127.0.0.2")
	ag := dnsAgent(t, port, r)
	waitLinks(t, ag.Agent, "node-x:connected node-x:standby")
	var standing LinkStatus
	for _, l := range ag.Links() {
		if l.State == StateStandby {
			standing = l
		}
	}
	if !strings.Contains(standing.LastError, `node "node-x" is served by the session with`) {
		t.Errorf("standby link %+v: want the reason", standing)
	}
	if ready, _ := ag.Ready(); !ready {
		t.Error("not ready with one link connected")
	}

	// The address of the connected link goes: the other one takes over.
	connectedTo, standby := first, second
	if standing.URL == "grpc://"+first.addr {
		connectedTo, standby = second, first
	}
	addr, _, _ := net.SplitHostPort(standby.addr)
	r.set(addr)
	waitLinks(t, ag.Agent, "node-x:connected")
	if ag.Links()[0].URL != "grpc://"+standby.addr {
		t.Errorf("links %+v: want the one of %s", ag.Links(), standby.addr)
	}
	if connectedTo.attempts.Load() != 1 {
		t.Errorf("the first node saw %d attempts, want 1: a link standing by does not displace", connectedTo.attempts.Load())
	}
}

// TestReadyzWithOneOfTwoLinksDown: /readyz stays 200 while one link is
// connected and lists each node's state; 503 once none is.
func TestReadyzWithOneOfTwoLinksDown(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	b := newFakeNode(t, "secret", nodeOptions{id: "node-b"})
	cfg := echoConfig(t, a.addr)
	cfg.AdminListen = "127.0.0.1:0"
	ag := startAgent(t, cfg)
	nsA := a.next(t)
	sendMembership(t, nsA, self(a), memberOf(b))
	b.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected")
	code, body := adminGet(t, ag.Agent, "/readyz")
	if code != 200 || !strings.HasPrefix(body, "ready\nnode node-a grpc://"+a.addr+" connected since ") ||
		!strings.Contains(body, "\nnode node-b grpc://"+b.addr+" connected since ") {
		t.Errorf("/readyz %d %q", code, body)
	}

	b.stop()
	waitFor(t, 10*time.Second, "node-b's link down", func() bool { return strings.Contains(linkSummary(ag.Agent), "node-b:retrying") })
	code, body = adminGet(t, ag.Agent, "/readyz")
	// node-b's link retries, every 20 to 200 ms: connecting or retrying.
	if down := regexp.MustCompile(`\nnode node-b grpc://` + regexp.QuoteMeta(b.addr) + ` (retrying|connecting) since \S+ last_error="`); code != 200 || !down.MatchString(body) {
		t.Errorf("/readyz with node-b down: %d %q", code, body)
	}
	_, metrics := adminGet(t, ag.Agent, "/metrics")
	for _, line := range []string{
		"sluice_tunnel_sessions 1",
		`sluice_node_session_state{node="node-a",state="connected",url="grpc://` + a.addr + `"} 1`,
		`sluice_node_session_state{node="node-b",state="connected",url="grpc://` + b.addr + `"} 0`,
		`sluice_node_session_state{node="node-b",state="standby",url="grpc://` + b.addr + `"} 0`,
	} {
		if !strings.Contains(metrics, "\n"+line) {
			t.Errorf("/metrics lacks %q", line)
		}
	}

	a.stop()
	waitFor(t, 10*time.Second, "unreadiness", func() bool { code, _ := adminGet(t, ag.Agent, "/readyz"); return code == 503 })
	if _, body := adminGet(t, ag.Agent, "/readyz"); !strings.HasPrefix(body, "not ready: no session with any of the 2 nodes\nnode node-a ") {
		t.Errorf("/readyz with both down: %q", body)
	}
}

// TestLeaveWithSeveralLinks: Leave drains every link at once, serves the
// open connections on each until they finish, and returns once every
// session ended; no link reconnects.
func TestLeaveWithSeveralLinks(t *testing.T) {
	a := newFakeNode(t, "secret", nodeOptions{id: "node-a"})
	b := newFakeNode(t, "secret", nodeOptions{id: "node-b"})
	c := newFakeNode(t, "secret", nodeOptions{id: "node-c"})
	ag := startAgent(t, echoConfig(t, a.addr))
	nsA := a.next(t)
	sendMembership(t, nsA, self(a), memberOf(b), memberOf(c))
	sessions := []*nodeSession{nsA, b.next(t), c.next(t)}
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected node-c:connected")
	var conns []net.Conn
	for _, ns := range sessions {
		conns = append(conns, echoOnce(t, ns.sess))
	}

	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	left := leaveAsync(ag, ctx)
	for i, ns := range sessions {
		if d := awaitDrain(t, ns, "leaving"); d.GetReason() != errLeft.Error() {
			t.Errorf("session %d: Drain %v", i, d)
		}
	}
	waitLinks(t, ag.Agent, "node-a:leaving node-b:leaving node-c:leaving")
	if ready, _ := ag.Ready(); ready {
		t.Error("ready while leaving")
	}
	for i, c := range conns {
		mustEcho(t, c) // still served
		select {
		case err := <-left:
			t.Fatalf("Leave returned %v with %d connections open", err, len(conns)-i)
		default:
		}
		c.Close()
	}
	select {
	case err := <-left:
		if err != nil {
			t.Fatalf("Leave: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Leave did not return once the connections closed")
	}
	if err := ag.stop(t); err != nil || ag.State() != StateStopped || len(ag.Links()) != 0 {
		t.Fatalf("Run %v, state %v, links %+v", err, ag.State(), ag.Links())
	}
	for i, n := range []*fakeNode{a, b, c} {
		if got := n.attempts.Load(); got != 1 {
			t.Errorf("node %d saw %d attempts: a link reconnected after leaving", i, got)
		}
	}
}

// testCA issues server certificates for the names given.
type testCA struct {
	pem  []byte
	cert *x509.Certificate
	key  *ecdsa.PrivateKey
}

func newTestCA(t testing.TB) *testCA {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "sluice test CA"},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	cert, _ := x509.ParseCertificate(der)
	return &testCA{pem: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), cert: cert, key: key}
}

// creds are a node's TLS credentials with a certificate for names (IP
// addresses or DNS names) alone.
func (ca *testCA) creds(t testing.TB, names ...string) credentials.TransportCredentials {
	t.Helper()
	return credentials.NewTLS(&tls.Config{Certificates: []tls.Certificate{ca.serverCert(t, names...)}})
}

// serverCert is a server certificate for names (IP addresses or DNS
// names) alone, signed by ca.
func (ca *testCA) serverCert(t testing.TB, names ...string) tls.Certificate {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber: big.NewInt(time.Now().UnixNano()), Subject: pkix.Name{CommonName: names[0]},
		NotBefore: time.Now().Add(-time.Hour), NotAfter: time.Now().Add(time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, n := range names {
		if ip := net.ParseIP(n); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, n)
		}
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, ca.cert, &key.PublicKey, ca.key)
	if err != nil {
		t.Fatal(err)
	}
	return tls.Certificate{Certificate: [][]byte{der}, PrivateKey: key}
}

// TestMembersOverTLSVerifyTheirOwnNames: with a grpcs:// server, each
// member is verified against its own URL's host (with the agent's
// ca_file), not the server's; a grpc:// member is refused.
func TestMembersOverTLSVerifyTheirOwnNames(t *testing.T) {
	ca := newTestCA(t)
	lns := sharedPortListeners(t, 2)
	a := newFakeNode(t, "secret", nodeOptions{lis: lns[0], id: "node-a", creds: ca.creds(t, "127.0.0.1")})
	b := newFakeNode(t, "secret", nodeOptions{lis: lns[1], id: "node-b", creds: ca.creds(t, "127.0.0.2")})
	cfg := echoConfig(t, a.addr)
	cfg.Server = "grpcs://" + a.addr
	cfg.CAFile = writeFile(t, "ca.pem", string(ca.pem))
	ag := startAgent(t, cfg)
	nsA := a.next(t)
	sendMembership(t, nsA, self(a), &tunnelpb.Node{Id: "node-b", Url: "grpcs://" + b.addr},
		&tunnelpb.Node{Id: "node-c", Url: "grpc://127.0.0.3:1"})
	b.next(t)
	waitLinks(t, ag.Agent, "node-a:connected node-b:connected")
	if !hasLog(ag.logs, "membership: a member's url is not usable", "member", "node-c") {
		t.Error("the grpc:// member of a grpcs:// cluster was not refused")
	}
}

// TestServerEachAddressOverTLS: the links to the addresses of the
// server's name verify the name, as a dial of the name would.
func TestServerEachAddressOverTLS(t *testing.T) {
	ca := newTestCA(t)
	lns := sharedPortListeners(t, 2)
	one := newFakeNode(t, "secret", nodeOptions{lis: lns[0], id: "node-1", creds: ca.creds(t, "nodes.test")})
	two := newFakeNode(t, "secret", nodeOptions{lis: lns[1], id: "node-2", creds: ca.creds(t, "nodes.test")})
	_, port, _ := net.SplitHostPort(one.addr)
	r := new(fakeResolver)
	r.set("127.0.0.1", "127.0.0.2")
	cfg := echoConfig(t, "nodes.test:"+port)
	cfg.Server = "grpcs://nodes.test:" + port
	cfg.CAFile = writeFile(t, "ca.pem", string(ca.pem))
	cfg.ServerEachAddress = true
	ag := startAgent(t, cfg, func(a *Agent) { a.resolve, a.serverRefresh = r.resolve, 10*time.Millisecond })
	one.next(t)
	two.next(t)
	waitLinks(t, ag.Agent, "node-1:connected node-2:connected")
	if l := ag.Links()[1]; l.URL != "grpcs://127.0.0.2:"+port {
		t.Errorf("link %+v", l)
	}
}

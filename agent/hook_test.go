package agent

import (
	"io"
	"net"
	"strings"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// nextReport waits for the next report the WithConnEnd hook got.
func nextReport(t *testing.T, reports <-chan ConnReport) ConnReport {
	t.Helper()
	select {
	case r := <-reports:
		return r
	case <-time.After(10 * time.Second):
		t.Fatal("no connection report within 10s")
		return ConnReport{}
	}
}

// TestConnEndReportsEveryConnection: one report per connection the node
// opens, with its route, target, client, bytes, times and outcome: a clean
// relay, an upstream that refuses, one that resets, an unknown route, one
// over the limit.
func TestConnEndReportsEveryConnection(t *testing.T) {
	echo := echoUpstream(t)
	down := closedPort(t)
	rst := serveUpstream(t, func(c net.Conn) { // resets every connection once it sent a byte
		io.ReadFull(c, make([]byte, 1))
		c.(*net.TCPConn).SetLinger(0)
		c.Close()
	})
	node := newFakeNode(t, "secret", nodeOptions{})
	cfg := testConfig(node.addr, "secret",
		Upstream{Name: "echo", Target: "tcp://" + echo},
		Upstream{Name: "down", Target: "tcp://" + down},
		Upstream{Name: "rst", Target: "tcp://" + rst})
	cfg.MaxConnections = 1
	reports := make(chan ConnReport, 16)
	ag := startAgentWith(t, cfg, []Option{WithConnEnd(func(r ConnReport) { reports <- r })})
	ns := node.next(t)
	const client = "203.0.113.7:4242"
	start := time.Now()

	// Clean: the client sends, half-closes, reads the echo to its end.
	c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo", RemoteAddr: client})
	if err != nil {
		t.Fatal(err)
	}
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write([]byte("hello, upstream")); err != nil {
		t.Fatal(err)
	}
	c.CloseWrite()
	if got, err := io.ReadAll(c); err != nil || string(got) != "hello, upstream" {
		t.Fatalf("echo %q %v", got, err)
	}
	c.Close()
	r := nextReport(t, reports)
	if n := ag.ActiveConns(); n != 0 {
		t.Errorf("ActiveConns %d once the connection was reported, want 0", n)
	}
	if r.Route != "echo" || r.Target != "tcp://"+echo || r.ClientAddr != client || r.ID != c.ID() ||
		r.Outcome != ConnOK || r.Err != nil || r.FromClient != 15 || r.ToClient != 15 {
		t.Errorf("clean relay reported %+v", r)
	}
	if r.OpenedAt.Before(start) || r.Duration <= 0 || r.OpenedAt.Add(r.Duration).After(time.Now()) {
		t.Errorf("clean relay: opened %v for %v, test started %v", r.OpenedAt, r.Duration, start)
	}

	// Refused by the upstream.
	c, err = ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "down", RemoteAddr: client})
	if err != nil {
		t.Fatal(err)
	}
	if pe := peerError(t, c); pe.Code != tunnelpb.Error_DIAL_FAILED {
		t.Fatalf("got %v", pe)
	}
	r = nextReport(t, reports)
	if r.Route != "down" || r.Target != "tcp://"+down || r.Outcome != ConnUpstreamRefused ||
		r.Err == nil || !strings.Contains(r.Err.Error(), "dial tcp://"+down) || r.FromClient+r.ToClient != 0 {
		t.Errorf("refused dial reported %+v", r)
	}

	// Reset by the upstream.
	c, err = ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "rst"})
	if err != nil {
		t.Fatal(err)
	}
	c.Write([]byte("x"))
	peerError(t, c)
	if r = nextReport(t, reports); r.Route != "rst" || r.Outcome != ConnReset || r.Err == nil {
		t.Errorf("upstream reset reported %+v", r)
	}

	// No such route.
	c, err = ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "nope"})
	if err != nil {
		t.Fatal(err)
	}
	peerError(t, c)
	if r = nextReport(t, reports); r.Route != "nope" || r.Target != "" || r.Outcome != ConnUnknownRoute || r.Err == nil {
		t.Errorf("unknown route reported %+v", r)
	}

	// Over max_connections (1) while an echo is open; then the open one
	// ends and is reported too.
	held := echoOnce(t, ns.sess)
	c, err = ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo"})
	if err != nil {
		t.Fatal(err)
	}
	peerError(t, c)
	if r = nextReport(t, reports); r.Outcome != ConnLimit || r.Route != "echo" || r.Err == nil {
		t.Errorf("refusal at the limit reported %+v", r)
	}
	held.Close()
	if r = nextReport(t, reports); r.ID != held.(*tunnelcore.Conn).ID() || r.FromClient != 4 || r.ToClient != 4 {
		t.Errorf("held connection reported %+v", r)
	}
	select {
	case r := <-reports:
		t.Errorf("a report too many: %+v", r)
	default:
	}
}

func TestConnOutcomeString(t *testing.T) {
	for o, want := range map[ConnOutcome]string{
		ConnOK: "ok", ConnUnknownRoute: "unknown_route", ConnLimit: "limit", ConnUpstreamRefused: "upstream_refused",
		ConnUpstreamFailed: "upstream_failed", ConnAbandoned: "abandoned", ConnReset: "reset", ConnOutcome(99): "ConnOutcome(99)",
	} {
		if got := o.String(); got != want {
			t.Errorf("%d: %q, want %q", int(o), got, want)
		}
	}
}

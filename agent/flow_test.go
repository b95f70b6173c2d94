package agent

import (
	"bytes"
	"errors"
	"fmt"
	"net"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"
	"github.com/prometheus/common/expfmt"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// udpEchoServer echoes each datagram to its sender until the test ends,
// and records the addresses it heard from.
type udpEchoServer struct {
	addr    *net.UDPAddr
	mu      sync.Mutex
	senders map[string]bool
}

func serveUDPEcho(t *testing.T) *udpEchoServer {
	t.Helper()
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	e := &udpEchoServer{addr: pc.LocalAddr().(*net.UDPAddr), senders: map[string]bool{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFromUDP(buf)
			if err != nil {
				return
			}
			e.mu.Lock()
			e.senders[from.String()] = true
			e.mu.Unlock()
			pc.WriteToUDP(buf[:n], from)
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return e
}

func (e *udpEchoServer) distinct() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.senders)
}

// TestAgentRelaysFlows: the agent relays each flow the node opens for a
// udp:// route over a socket of its own (the upstream sees one source
// address per flow, and each flow gets its own replies), datagrams whole;
// a flow idle for the route's udp_idle_timeout ends on the agent, and its
// metrics count what the flows carried.
func TestAgentRelaysFlows(t *testing.T) {
	echo := serveUDPEcho(t)
	node := newFakeNode(t, "secret", nodeOptions{})
	a := startAgent(t, testConfig(node.addr, "secret",
		Upstream{Name: "echo", Target: "udp://" + echo.addr.String(), UDPIdleTimeout: 300 * time.Millisecond}))
	ns := node.next(t)
	if rt := ns.adv.GetRoutes()[0]; rt.GetTarget() != "udp://"+echo.addr.String() || rt.GetUdpIdleTimeoutMs() != 300 {
		t.Fatalf("advertised %v", rt)
	}
	flows := make([]*tunnelcore.Conn, 5)
	for i := range flows {
		f, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: "echo", RemoteAddr: fmt.Sprintf("203.0.113.%d:5000", i+1), Datagram: true})
		if err != nil {
			t.Fatal(err)
		}
		flows[i] = f
	}
	buf := make([]byte, 70000)
	for i, f := range flows {
		for _, n := range []int{1, 1400, 65000} {
			msg := bytes.Repeat([]byte{byte('a' + i)}, n)
			if err := f.WriteDatagram(msg); err != nil {
				t.Fatal(err)
			}
			f.SetReadDeadline(time.Now().Add(10 * time.Second))
			m, err := f.ReadDatagram(buf)
			if err != nil || !bytes.Equal(buf[:m], msg) {
				t.Fatalf("flow %d, %d bytes: got %d bytes back, %v", i, n, m, err)
			}
		}
	}
	if got := echo.distinct(); got != len(flows) {
		t.Errorf("the upstream heard from %d sockets, want one per flow (%d)", got, len(flows))
	}
	// Idle: the agent ends each flow (the node's end reads EOF).
	for i, f := range flows {
		f.SetReadDeadline(time.Now().Add(10 * time.Second))
		if _, err := f.ReadDatagram(buf); err == nil || errors.Is(err, os.ErrDeadlineExceeded) {
			t.Fatalf("flow %d: read %v, want the agent to end the idle flow", i, err)
		}
	}
	waitFor(t, 5*time.Second, "the flows to leave the active count", func() bool {
		return a.tunnel.Flows.Active.Load() == 0
	})
	out, err := testutil.CollectAndFormat(a.MetricsCollector(), expfmt.TypeTextPlain,
		"sluice_udp_flows_active", "sluice_udp_flows_idle_total", "sluice_udp_datagrams_total")
	if err != nil {
		t.Fatal(err)
	}
	text := string(out)
	for _, want := range []string{`sluice_udp_flows_active 0`, `sluice_udp_flows_idle_total 5`, `sluice_udp_datagrams_total{direction="from_client"} 15`,
		`sluice_udp_datagrams_total{direction="to_client"} 15`} {
		if !strings.Contains(text, want) {
			t.Errorf("metrics lack %q:\n%s", want, text)
		}
	}
}

// TestAgentRefusesMismatchedKinds: strict forwarding holds for flows too:
// a flow for a route whose target is not udp://, or a connection for a
// udp:// route, is refused (REFUSED), and nothing is dialed.
func TestAgentRefusesMismatchedKinds(t *testing.T) {
	echo := serveUDPEcho(t)
	node := newFakeNode(t, "secret", nodeOptions{})
	startAgent(t, testConfig(node.addr, "secret",
		Upstream{Name: "dns", Target: "udp://" + echo.addr.String()},
		Upstream{Name: "redis", Target: "tcp://127.0.0.1:1"}))
	ns := node.next(t)
	for _, tc := range []struct {
		route    string
		datagram bool
	}{{"redis", true}, {"dns", false}, {"nope", true}} {
		c, err := ns.sess.Open(tunnelcore.ConnectInfo{RouteKey: tc.route, Datagram: tc.datagram})
		if err != nil {
			t.Fatal(err)
		}
		if pe := peerError(t, c); pe.Code != tunnelpb.Error_REFUSED {
			t.Errorf("%s (datagram %v): %v, want REFUSED", tc.route, tc.datagram, pe)
		}
	}
	if echo.distinct() != 0 {
		t.Error("the upstream heard from a refused flow")
	}
}

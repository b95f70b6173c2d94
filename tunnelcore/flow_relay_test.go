package tunnelcore

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"testing"
	"time"
)

// udpEcho serves a UDP echo on loopback until the test ends and returns
// its address. Each reply goes to the datagram's sender, prefixed with
// prefix.
func udpEcho(t testing.TB, prefix string) *net.UDPAddr {
	t.Helper()
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	pc.SetReadBuffer(4 << 20)
	t.Cleanup(func() { pc.Close() })
	go func() {
		buf := make([]byte, MaxDatagram)
		for {
			n, from, err := pc.ReadFromUDP(buf)
			if err != nil {
				return
			}
			pc.WriteToUDP(append([]byte(prefix), buf[:n]...), from)
		}
	}()
	return pc.LocalAddr().(*net.UDPAddr)
}

// flowRelayed is how one of relayAgent's relays ended, and its socket.
type flowRelayed struct {
	res  RelayResult
	sock *net.UDPConn
}

// relayAgent accepts every flow on agent and relays it to a connected UDP
// socket of its own to upstream, as sluice's agent does; each relay's
// result and socket are sent on the returned channel when it ends.
func relayAgent(t testing.TB, agent *Session, upstream *net.UDPAddr) <-chan flowRelayed {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := make(chan flowRelayed, 4096)
	var wg sync.WaitGroup
	t.Cleanup(func() { cancel(); wg.Wait() })
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			f, err := agent.Accept(ctx)
			if err != nil {
				return
			}
			sock, err := net.DialUDP("udp", nil, upstream)
			if err != nil {
				f.Abort(0, "")
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				out <- flowRelayed{RelayDatagrams(f, sock, 0), sock}
			}()
		}
	}()
	return out
}

// TestRelayDatagramsThroughUDP: a flow flowRelayed to a real UDP upstream
// carries each datagram whole both ways, up to 65000 bytes.
func TestRelayDatagramsThroughUDP(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		node, agent := sessionPair(t, tr, Config{}, Config{})
		relayAgent(t, agent, udpEcho(t, ""))
		nf, err := node.Open(ConnectInfo{RouteKey: "echo", Datagram: true})
		if err != nil {
			t.Fatal(err)
		}
		defer nf.Close()
		buf := make([]byte, MaxDatagram)
		for i, n := range []int{1, 512, 1472, 9000, 65000} {
			if err := nf.WriteDatagram(datagram(i, n)); err != nil {
				t.Fatal(err)
			}
			m, err := nf.ReadDatagram(buf)
			if err != nil || !bytes.Equal(buf[:m], datagram(i, n)) {
				t.Fatalf("echo of %d bytes: %d bytes, %v", n, m, err)
			}
		}
	})
}

// TestFlowsManyClients: a thousand flows at once, each flowRelayed to an
// upstream over a socket of its own, each get their own replies; then
// every flow ends and the agent's sockets with them.
func TestFlowsManyClients(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		const flows = 1000
		var nodeCounts, agentCounts Counters
		node, agent := sessionPair(t, tr, Config{Counters: &nodeCounts}, Config{Counters: &agentCounts})
		ends := relayAgent(t, agent, udpEcho(t, "re:"))
		nfs := make([]*Conn, flows)
		for i := range nfs {
			f, err := node.Open(ConnectInfo{RouteKey: "echo", RemoteAddr: fmt.Sprintf("198.51.100.%d:%d", i%250+1, 1024+i), Datagram: true})
			if err != nil {
				t.Fatal(err)
			}
			nfs[i] = f
		}
		errs := make(chan error, flows)
		var wg sync.WaitGroup
		for i, f := range nfs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs <- askEcho(f, fmt.Sprintf("client %d", i))
			}()
		}
		wg.Wait()
		close(errs)
		for err := range errs {
			if err != nil {
				t.Fatal(err)
			}
		}
		if n := agentCounts.Flows.Active.Load(); n != flows {
			t.Errorf("agent counts %d active flows, want %d", n, flows)
		}
		for _, f := range nfs {
			f.Close()
		}
		for range flows {
			select {
			case r := <-ends:
				if r.res.Err != nil {
					t.Errorf("relay ended with %v", r.res.Err)
				}
				if _, err := r.sock.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
					t.Errorf("the agent's socket is still open: %v", err)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("not every relay ended")
			}
		}
		eventually(t, 5*time.Second, "no flow active", func() bool {
			return nodeCounts.Flows.Active.Load() == 0 && agentCounts.Flows.Active.Load() == 0
		})
	})
}

// askEcho sends msg on f until the echo's reply comes (UDP may lose a
// datagram: the upstream's socket, the test's two cores) and checks that
// it is this flow's own.
func askEcho(f *Conn, msg string) error {
	buf := make([]byte, 100)
	for range 20 {
		if err := f.WriteDatagram([]byte(msg)); err != nil {
			return err
		}
		f.SetReadDeadline(time.Now().Add(500 * time.Millisecond))
		n, err := f.ReadDatagram(buf)
		if isTimeout(err) {
			continue
		}
		if err != nil {
			return err
		}
		if got := string(buf[:n]); got != "re:"+msg {
			return fmt.Errorf("flow of %q got %q", msg, got)
		}
		return nil
	}
	return fmt.Errorf("flow of %q: no reply", msg)
}

// TestRelayDatagramsIdleClosesSocket: a flow that idles ends its relay
// cleanly and closes the upstream socket; the node's side reads io.EOF.
func TestRelayDatagramsIdleClosesSocket(t *testing.T) {
	node, agent := sessionPair(t, transports[2], Config{FlowIdleTimeout: time.Hour}, Config{FlowIdleTimeout: 200 * time.Millisecond})
	ends := relayAgent(t, agent, udpEcho(t, ""))
	nf, err := node.Open(ConnectInfo{RouteKey: "echo", Datagram: true})
	if err != nil {
		t.Fatal(err)
	}
	defer nf.Close()
	if err := askEchoPlain(nf, "hello"); err != nil {
		t.Fatal(err)
	}
	select {
	case r := <-ends:
		if r.res.Err != nil || r.res.AToB != 5 || r.res.BToA != 5 {
			t.Errorf("relay result %+v", r.res)
		}
		if _, err := r.sock.Write([]byte("x")); !errors.Is(err, net.ErrClosed) {
			t.Errorf("the upstream socket is still open: %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the idle flow's relay never ended")
	}
	if _, err := nf.ReadDatagram(make([]byte, 10)); err == nil {
		t.Fatal("the node's flow still reads")
	}
}

func askEchoPlain(f *Conn, msg string) error {
	if err := f.WriteDatagram([]byte(msg)); err != nil {
		return err
	}
	buf := make([]byte, 100)
	n, err := f.ReadDatagram(buf)
	if err != nil || string(buf[:n]) != msg {
		return fmt.Errorf("echo: %q, %v", buf[:n], err)
	}
	return nil
}

// TestRelayDatagramsRefusedPort: a datagram to an upstream port nobody
// serves (ICMP port unreachable, then ECONNREFUSED on the connected
// socket) is lost, and the relay goes on, as for a UDP client.
func TestRelayDatagramsRefusedPort(t *testing.T) {
	closed, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	addr := closed.LocalAddr().(*net.UDPAddr)
	closed.Close()
	node, agent := sessionPair(t, transports[0], Config{}, Config{})
	ends := relayAgent(t, agent, addr)
	nf, err := node.Open(ConnectInfo{RouteKey: "gone", Datagram: true})
	if err != nil {
		t.Fatal(err)
	}
	for range 5 {
		if err := nf.WriteDatagram([]byte("anyone?")); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, 5*time.Second, "the datagrams to reach the relay", func() bool {
		return agent.NumConns() == 1 && agent.Conns()[0].FlowStats().Received == 5
	})
	select {
	case r := <-ends:
		t.Fatalf("the relay ended: %+v", r.res)
	default:
	}
	nf.Close()
	select {
	case r := <-ends:
		if r.res.Err != nil {
			t.Errorf("relay result %+v", r.res)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the relay never ended")
	}
}

package caddymodule

import (
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// udpPort is a UDP port the node bound for udp:// listen-port routes
// (udp_port_range). One socket takes every client's datagrams and one
// goroutine reads it: each datagram goes to its client address's flow,
// opened on the port's current owner at the client's first datagram, and
// is queued there or dropped, never waited for. Each flow's replies are
// written back by a goroutine of its own, from the same socket, to that
// client alone.
type udpPort struct {
	n     *node
	sock  *net.UDPConn
	owner func() *routeEntry

	mu      sync.Mutex
	clients map[netip.AddrPort]*udpClient
	closed  bool
}

// udpClient is one client address of a udpPort and its flow.
type udpClient struct {
	flow    *tunnelcore.Conn
	release func() // the flow's limits
}

// udpSocketBuffer is the receive and send buffer asked of a bound UDP
// port (the kernel caps it at net.core.rmem_max / wmem_max): a burst the
// reader has not taken yet waits there instead of being dropped.
const udpSocketBuffer = 4 << 20

// listenUDPPort binds addr for the udp:// listen-port routes of a port
// whose current owner owner returns; serve starts it.
func (n *node) listenUDPPort(addr string, owner func() *routeEntry) (*udpPort, error) {
	pc, err := net.ListenPacket("udp", addr)
	if err != nil {
		return nil, err
	}
	sock := pc.(*net.UDPConn)
	sock.SetReadBuffer(udpSocketBuffer)
	sock.SetWriteBuffer(udpSocketBuffer)
	return &udpPort{n: n, sock: sock, owner: owner, clients: map[netip.AddrPort]*udpClient{}}, nil
}

// serve reads the port until it is closed, handing each datagram to its
// client's flow. Another read error is waited out with a backoff, as the
// TCP ports' accept errors are.
func (p *udpPort) serve() {
	buf := make([]byte, tunnelcore.MaxDatagram)
	var delay time.Duration
	for {
		n, from, err := p.sock.ReadFromUDPAddrPort(buf)
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			if ok, suppressed := p.n.acceptLog.Allow(); ok {
				p.n.log().Error("reading agent UDP port route; retrying", zap.String("address", p.sock.LocalAddr().String()),
					zap.Error(err), zap.Duration("retry_in", delay), zap.Int("suppressed", suppressed))
			}
			time.Sleep(delay)
			continue
		}
		delay = 0
		if f := p.flowOf(from); f != nil {
			f.WriteDatagram(buf[:n]) // queued or dropped (and counted): never waits
		}
	}
}

// flowOf returns the flow of client from, opening it at its first
// datagram; nil when the client is refused (counted by openFlow).
func (p *udpPort) flowOf(from netip.AddrPort) *tunnelcore.Conn {
	from = netip.AddrPortFrom(from.Addr().Unmap(), from.Port())
	p.mu.Lock()
	c := p.clients[from]
	p.mu.Unlock()
	if c != nil {
		return c.flow
	}
	f, release, err := p.n.openFlowAgain(p.owner, from.String(), p.sock.LocalAddr().String(), "")
	if err != nil {
		return nil
	}
	c = &udpClient{flow: f, release: release}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		f.Close()
		release()
		return nil
	}
	p.clients[from] = c
	p.mu.Unlock()
	go p.reply(from, c)
	return f
}

// reply writes the flow's datagrams to its client until the flow ends
// (idle, the agent's end, the port's close), then forgets the client: its
// next datagram opens a new flow, to whichever agent owns the port then.
func (p *udpPort) reply(to netip.AddrPort, c *udpClient) {
	for {
		b, err := c.flow.TakeDatagram()
		if err != nil {
			break
		}
		p.sock.WriteToUDPAddrPort(b.ReadOnlyData(), to) // a client gone is UDP's loss
		b.Free()
	}
	c.flow.Close()
	p.mu.Lock()
	if p.clients[to] == c {
		delete(p.clients, to)
	}
	p.mu.Unlock()
	c.release()
}

// close closes the socket and ends every client's flow.
func (p *udpPort) close() {
	p.sock.Close()
	p.mu.Lock()
	p.closed = true
	clients := make([]*udpClient, 0, len(p.clients))
	for _, c := range p.clients {
		clients = append(clients, c)
	}
	p.mu.Unlock()
	for _, c := range clients {
		c.flow.Close() // its reply goroutine forgets it
	}
}

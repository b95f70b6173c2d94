package caddymodule

import (
	"errors"
	"fmt"
	"net"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// UDP through the tunnel: each client address of a udp:// route gets a
// datagram flow of its own to the agent (proto/README §6.1), opened when
// its first datagram arrives and ended by the route's idle timeout. Two
// front doors: a layer4 UDP server's `sluice` handler (RelayUDP: caddy-l4
// hands it one connection per client address) and the UDP ports the node
// binds for listen-port routes (udpports.go: one socket, every client).
// Neither ever waits on a flow: a flow's writes queue or drop.

// UDPTarget selects the route of a UDP client: an explicit route name,
// else the port the client sent to. LB chooses among the agents serving
// it (nil: the first, by agent id), once per client flow: a flow's
// datagrams all go to the agent its first one went to. A port the node
// bound has one agent, its owner, whatever LB says.
type UDPTarget struct {
	Route     string
	LocalPort uint32
	LB        *LBPolicy
}

// udpNode is a node's datagram flows: their limits, what was refused
// before a flow opened, and the UDP ports it binds.
type udpNode struct {
	n      *node
	ports  *portManager
	flows  counterLimiter // max_udp_flows
	byAddr *addrLimiter   // max_udp_flows_per_address, by client IP
	// refused counts the clients (on a bound port: the datagrams) dropped
	// before a flow could open, by reason (udpRefusalNames).
	refused [len(udpRefusalNames)]atomic.Int64
	log     *logthrottle.Throttle
}

func (u *udpNode) init(n *node) {
	u.n = n
	u.ports = newPortManager(n)
	u.ports.udp = true
	u.byAddr = newAddrLimiter()
	u.log = logthrottle.New(10*time.Second, 5)
}

// udpRefusalNames are the reasons a client's datagram was dropped before
// a flow opened (the reason label of sluice_udp_datagrams_dropped_total,
// beside the flows' own reasons).
var udpRefusalNames = [...]string{"no_route", "allowed_cidrs", "max_udp_flows", "max_udp_flows_per_address", "max_connections", "open_failed"}

// udpRefusal indexes udpRefusalNames.
type udpRefusal int

const (
	udpNoRoute udpRefusal = iota
	udpForbidden
	udpMaxFlows
	udpMaxFlowsPerAddr
	udpMaxConnections
	udpOpenFailed
)

// refuse counts a client refused for r and logs it through the throttle.
func (u *udpNode) refuse(r udpRefusal, client, routeName string) {
	u.refused[r].Add(1)
	if ok, suppressed := u.log.Allow(); ok {
		u.n.log().Warn("UDP client refused; its datagrams are dropped", zap.String("reason", udpRefusalNames[r]),
			zap.String("client", client), zap.String("route", routeName), zap.Int("suppressed", suppressed))
	}
}

// RelayUDP carries the datagrams of one client of a layer4 UDP server to
// the agent route target selects, in a datagram flow, until the flow ends
// (the route's idle timeout, the agent's end) or client does (caddy-l4's
// own idle_timeout). client is caddy-l4's connection for the client's
// address: each Read returns one datagram (at most 9000 bytes, caddy-l4's
// buffers), each Write sends one. It returns ErrNoRoute, ErrForbidden or
// ErrLimit for a client refused (counted, logged through a throttle), and
// a relay's real failure otherwise.
func (a *App) RelayUDP(client net.Conn, target UDPTarget) error {
	n := a.node
	resolve := func() *routeEntry { return n.resolveUDP(target) }
	f, release, err := n.openFlowAgain(resolve, client.RemoteAddr().String(), client.LocalAddr().String(), target.Route)
	if err != nil {
		return err
	}
	defer release()
	res := tunnelcore.RelayDatagrams(f, client, l4DatagramSize)
	if res.Err != nil {
		return fmt.Errorf("relaying datagrams: %w", res.Err)
	}
	return nil
}

// l4DatagramSize is the most one Read of caddy-l4's UDP connection
// returns: its server reads each datagram into a 9000-byte buffer.
const l4DatagramSize = 9000

// resolveUDP returns the route target selects in the current table: the
// UDP routes of that name (that their credential may serve by name), else
// the owner of the node's port, else the udp:// listen-port routes of the
// port (served by a layer4 server); among several, the one target.LB
// chooses.
func (n *node) resolveUDP(target UDPTarget) *routeEntry {
	t := n.reg.table.Load()
	if target.Route != "" {
		return target.LB.pick(datagramRoutes(reachableByName(t.byName.get(target.Route))))
	}
	if e := n.udp.ports.owner(target.LocalPort); e != nil {
		return e
	}
	return target.LB.pick(t.byUDPPort.get(target.LocalPort))
}

// datagramRoutes keeps the routes that take datagram flows.
func datagramRoutes(es []*routeEntry) []*routeEntry {
	return routesWhere(es, func(e *routeEntry) bool { return e.kind.Datagram() })
}

// streamRoutes keeps the routes that take connections.
func streamRoutes(es []*routeEntry) []*routeEntry {
	return routesWhere(es, func(e *routeEntry) bool { return !e.kind.Datagram() })
}

// routesWhere keeps the routes keep accepts, without copying when it
// accepts them all (the common case).
func routesWhere(es []*routeEntry, keep func(*routeEntry) bool) []*routeEntry {
	for i, e := range es {
		if !keep(e) {
			out := append([]*routeEntry(nil), es[:i]...)
			for _, e := range es[i+1:] {
				if keep(e) {
					out = append(out, e)
				}
			}
			return out
		}
	}
	return es
}

// openFlowAgain opens the flow of client (host:port) on the route resolve
// returns, once more with the route resolve returns then if that route's
// agent left between the lookup and the open (as relayTCPAgain does). name
// is what the client asked for, for the log.
func (n *node) openFlowAgain(resolve func() *routeEntry, client, local, name string) (*tunnelcore.Conn, func(), error) {
	e := resolve()
	if e == nil {
		n.udp.refuse(udpNoRoute, client, name)
		return nil, nil, ErrNoRoute
	}
	f, release, err := n.openFlow(e, client, local)
	if errors.Is(err, errAgentLeft) {
		if next := resolve(); next != nil && next.agent != e.agent {
			f, release, err = n.openFlow(next, client, local)
		}
	}
	if errors.Is(err, errAgentLeft) {
		n.udp.refuse(udpNoRoute, client, name)
		return nil, nil, ErrNoRoute
	}
	return f, release, err
}

// openFlow admits client on route e and opens its flow: allowed_cidrs,
// then the flow limits and a connection slot, none of which it waits for
// (a bound port's one reader serves every client: waiting for one would
// stall them all). The flow ends after the route's idle timeout. release
// gives the limits back; the caller runs it once the flow ended.
func (n *node) openFlow(e *routeEntry, client, local string) (*tunnelcore.Conn, func(), error) {
	name := routeName(e.route)
	if !e.allows(client) {
		n.udp.refuse(udpForbidden, client, name)
		return nil, nil, ErrForbidden
	}
	opts := n.opts.Load()
	releaseNode, ok := n.udp.flows.acquire(opts.udp.maxFlows)
	if !ok {
		n.udp.refuse(udpMaxFlows, client, name)
		return nil, nil, ErrLimit
	}
	releaseAddr, ok := n.udp.byAddr.acquire(client, opts.udp.maxFlowsPerAddr)
	if !ok {
		releaseNode()
		n.udp.refuse(udpMaxFlowsPerAddr, client, name)
		return nil, nil, ErrLimit
	}
	// The flow counts on its route (lb_policy least_conn) until release.
	active := e.conns()
	active.Add(1)
	release := func() { active.Add(-1); releaseAddr(); releaseNode() }
	f, err := n.openFlowOn(e.agent, tunnelcore.ConnectInfo{RouteKey: name, RemoteAddr: client, LocalAddr: local, Datagram: true})
	if err != nil {
		release()
		return nil, nil, n.flowOpenFailed(err, client, name)
	}
	f.SetIdleTimeout(udpIdleTimeout(e))
	return f, release, nil
}

// flowOpenFailed counts and returns why a flow of client did not open.
func (n *node) flowOpenFailed(err error, client, name string) error {
	switch {
	case errors.Is(err, errAgentLeft):
		return err // openFlowAgain tries the route's next agent
	case errors.Is(err, tunnelcore.ErrConnLimit):
		n.udp.refuse(udpMaxConnections, client, name)
		return ErrLimit
	}
	n.udp.refuse(udpOpenFailed, client, name)
	return fmt.Errorf("opening a datagram flow: %w", err)
}

// openFlowOn opens a flow on a's session. Unlike open it never waits for
// a connection slot.
func (n *node) openFlowOn(a *agentSession, info tunnelcore.ConnectInfo) (*tunnelcore.Conn, error) {
	if !a.startOpen() {
		return nil, errAgentLeft
	}
	defer a.opening.Add(-1)
	return a.sess.Open(info)
}

// udpIdleTimeout is how long a flow of route e may carry nothing before
// it ends: the route's udp_idle_timeout_ms, else the default.
func udpIdleTimeout(e *routeEntry) time.Duration {
	if ms := e.route.GetUdpIdleTimeoutMs(); ms > 0 {
		return time.Duration(ms) * time.Millisecond
	}
	return tunnelcore.DefaultFlowIdleTimeout
}

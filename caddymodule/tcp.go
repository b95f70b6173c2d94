package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TCPTarget selects the route of a raw TCP connection, in this order: an
// explicit route name, a TLS server name, the port the client connected to.
// A server name no route serves falls back to the port: caddy-l4's tls
// matcher records the name of every ClientHello it reads, also in a route
// that did not match, so a catch-all `route { sluice }` after it must
// still reach the port's route.
//
// LB chooses among the agents serving the route (nil: the first, by agent
// id). A port the node bound has one agent, its owner, whatever LB says.
type TCPTarget struct {
	Route      string
	ServerName string
	LocalPort  uint32
	LB         *LBPolicy
}

// ErrNoRoute is returned when no agent serves a TCP connection.
var ErrNoRoute = errors.New("sluice: no agent serves this connection")

// ErrForbidden is returned when the route's allowed_cidrs exclude the
// client (the connection was closed at once).
var ErrForbidden = errors.New("sluice: client address not allowed on this route")

// ErrLimit is returned when a connection limit refused a TCP connection
// (it was closed at once).
var ErrLimit = errors.New("sluice: connection limit reached")

// RelayTCP relays client verbatim to the agent route target selects, until
// both directions end. client may have bytes already read by matchers: it
// must replay them (a *layer4.Connection does).
func (a *App) RelayTCP(client net.Conn, target TCPTarget) error {
	e := a.node.resolveTCP(target)
	if e == nil {
		x := &tcpAccess{start: time.Now(), client: client.RemoteAddr().String(), serverName: target.ServerName, route: target.Route}
		a.node.logTCPAccess(x, ErrNoRoute)
		return ErrNoRoute
	}
	return a.node.relayTCPAgain(client, e, target.ServerName, func() *routeEntry { return a.node.resolveTCP(target) })
}

// resolveTCP returns the route target selects in the current table,
// chosen among its agents by target.LB. Each call chooses anew, so the
// retry of relayTCPAgain goes by the policy too.
func (n *node) resolveTCP(target TCPTarget) *routeEntry {
	t := n.reg.table.Load()
	var routes []*routeEntry
	switch {
	case target.Route != "":
		routes = t.lookupName(target.Route)
		if target.LB.spreads() && len(routes) == 1 && routeName(routes[0].route) != target.Route {
			routes = sniPeers(t, target.Route, routes) // found as a server name
		}
	case target.ServerName != "":
		routes = t.lookupSNI(target.ServerName)
		if target.LB.spreads() {
			routes = sniPeers(t, target.ServerName, routes)
		}
	}
	routes = streamRoutes(routes) // a name may be a UDP service's too
	if len(routes) == 0 && target.Route == "" {
		// A port the node bound (tcp_port_range) has one owner, the
		// agent that claimed it: no policy applies. A layer4 server's
		// own port is served by every agent advertising it.
		if e := n.ports.owner(target.LocalPort); e != nil {
			return e
		}
		routes = t.byPort.get(target.LocalPort)
	}
	return target.LB.pick(routes)
}

// relayTCPAgain is relayTCP, once more with the route again returns if e's
// agent left (errAgentLeft) between the lookup and the open: its routes
// are out of the table by then, so the connection goes to whichever agent
// serves it now, as it would have a moment later.
//
// It writes the connection's one access line (logTCPAccess) when it ends.
func (n *node) relayTCPAgain(client net.Conn, e *routeEntry, serverName string, again func() *routeEntry) error {
	x := &tcpAccess{start: time.Now(), client: client.RemoteAddr().String(), serverName: serverName, route: routeName(e.route), agent: e.agent}
	err := n.relayTCP(client, e, x)
	if errors.Is(err, errAgentLeft) {
		if next := again(); next != nil && next.agent != e.agent {
			x.route, x.agent = routeName(next.route), next.agent
			err = n.relayTCP(client, next, x)
		}
		if errors.Is(err, errAgentLeft) {
			client.Close()
		}
	}
	n.logTCPAccess(x, err)
	return err
}

// relayTCP opens a virtual connection for route e on its session and
// relays client through it, closing both when done or when the route's idle
// timeout passes with no byte either way.
// x records what the access line says.
func (n *node) relayTCP(client net.Conn, e *routeEntry, x *tcpAccess) error {
	// Counted before the open, not after: connections arriving together
	// then spread under least_conn instead of all seeing the same counts.
	e.conns().Add(1)
	defer e.conns().Add(-1)
	// The connection's peer: layer4's proxy_protocol handler (with its
	// allow list) replaces it with the PROXY header's source.
	if !e.allows(client.RemoteAddr().String()) {
		n.refuseTCP(client, "allowed_cidrs")
		return ErrForbidden
	}
	release, ok := n.clients.acquire(client.RemoteAddr().String(), n.opts.Load().maxConnsPerAddr)
	if !ok {
		n.refuseTCP(client, "max_connections_per_address")
		return ErrLimit
	}
	defer release()
	info := tunnelcore.ConnectInfo{
		RouteKey:   routeName(e.route),
		RemoteAddr: client.RemoteAddr().String(),
		LocalAddr:  client.LocalAddr().String(),
		ServerName: x.serverName,
	}
	up, err := n.open(context.Background(), e.agent, info)
	if errors.Is(err, tunnelcore.ErrConnLimit) {
		n.refuseTCP(client, "max_connections")
		return ErrLimit
	}
	if errors.Is(err, errAgentLeft) {
		return err // the caller tries the route's next agent (relayTCPAgain)
	}
	if err != nil {
		client.Close()
		x.outcome = accessOpenFailed
		return fmt.Errorf("opening a tunnel connection: %w", err)
	}
	idle := time.Duration(e.route.GetVerbatimIdleTimeoutMs()) * time.Millisecond
	if idle == 0 {
		idle = n.opts.Load().verbatimIdleTimeout
	}
	if idle <= 0 {
		return x.relayed(e, up, tunnelcore.Relay(client, up))
	}
	// A write to the client counts as each 16 KiB piece completes, so a
	// client reading slowly but steadily is not taken for idle.
	up.SetWriteToBatch(16 << 10)
	stop := watchIdle(up, idle, func() {
		n.log().Debug("closing idle TCP relay", zap.String("route", info.RouteKey), zap.Duration("idle", idle))
		x.idle.Store(true)
		client.Close()
		up.Close()
	})
	defer stop()
	return x.relayed(e, up, tunnelcore.Relay(client, up))
}

// relayed records a relay's route, connection and counts for the access
// line and returns its error, wrapped. The virtual connection's own counts
// are reported when it ends (node.connEnded).
func (x *tcpAccess) relayed(e *routeEntry, up *tunnelcore.Conn, res tunnelcore.RelayResult) error {
	x.served(e, up, res)
	if res.Err != nil {
		return fmt.Errorf("relaying: %w", res.Err)
	}
	return nil
}

// watchIdle calls onIdle once the virtual connection of a relay has moved
// no byte either way for timeout, polling its counters every timeout/4, and
// stops when the returned stop is called. Every relayed byte, in either
// direction, passes through the virtual connection, so its counters see
// all activity without wrapping either side (a wrapper would hide the
// connections' ReadFrom/WriteTo fast paths).
func watchIdle(c *tunnelcore.Conn, timeout time.Duration, onIdle func()) (stop func()) {
	done := make(chan struct{})
	var once sync.Once
	r, w := c.Counts()
	last, lastMove := r+w, time.Now()
	go func() {
		tick := time.NewTicker(max(timeout/4, 10*time.Millisecond))
		defer tick.Stop()
		for {
			select {
			case <-done:
				return
			case now := <-tick.C:
				r, w := c.Counts()
				if moved := r + w; moved != last {
					last, lastMove = moved, now
				} else if now.Sub(lastMove) >= timeout {
					onIdle()
					return
				}
			}
		}
	}()
	return func() { once.Do(func() { close(done) }) }
}

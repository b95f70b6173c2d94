// Package l4module is sluice's caddy-l4 handler, layer4.handlers.sluice: it
// relays a raw TCP connection verbatim to the agent serving it, chosen by an
// explicit route name, by the TLS server name (passthrough, or after
// caddy-l4's tls handler terminated TLS), or by the port the client
// connected to. On a UDP server it carries each client address's datagrams
// in a datagram flow to the agent's udp:// route, chosen by name or by the
// port. Routing and the tunnel live in caddymodule; this package only
// adapts caddy-l4 connections to it, and chooses among the agents serving
// a route by its lb_policy.
package l4module

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"syscall"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// Handler relays the connection to an agent over the tunnel. It is terminal:
// handlers after it never run. A connection no agent serves is closed at
// once.
type Handler struct {
	// Route names the agent route to relay to (its name, or its host).
	// Empty: the TLS server name a tls matcher or handler saw, else the
	// local port the client connected to (listen-port routes).
	Route string `json:"route,omitempty"`

	// LBPolicy chooses among the agents serving the route: "first" (the
	// default: the smallest agent id, the same on every node),
	// "round_robin", "random" or "least_conn" (the fewest connections
	// open on the route through this node; the first on a tie). A port
	// the node bound (tcp_port_range) has one agent, its owner. On a UDP
	// server the choice is made for each new client flow.
	LBPolicy string `json:"lb_policy,omitempty"`

	lb *caddymodule.LBPolicy
	// relay is the app's RelayTCP, relayUDP its RelayUDP (stand-ins in
	// tests).
	relay    func(net.Conn, caddymodule.TCPTarget) error
	relayUDP func(net.Conn, caddymodule.UDPTarget) error
	logger   *zap.Logger
	noRoute  *logthrottle.Throttle
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "layer4.handlers.sluice",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision checks lb_policy and finds the sluice app.
func (h *Handler) Provision(ctx caddy.Context) error {
	lb, err := caddymodule.NewLBPolicy(h.LBPolicy)
	if err != nil {
		return fmt.Errorf("lb_policy: %w", err)
	}
	h.lb = lb
	appAny, err := ctx.App("sluice")
	if err != nil {
		return fmt.Errorf("loading the sluice app: %w", err)
	}
	h.relay = appAny.(*caddymodule.App).RelayTCP
	h.relayUDP = appAny.(*caddymodule.App).RelayUDP
	h.logger = ctx.Logger()
	h.noRoute = logthrottle.New(10*time.Second, 1)
	return nil
}

// Handle implements layer4.NextHandler. It returns only the relay's real
// failures (see relayError).
func (h *Handler) Handle(cx *layer4.Connection, _ layer4.Handler) error {
	if local, ok := cx.LocalAddr().(*net.UDPAddr); ok {
		return h.handleUDP(cx, local)
	}
	target := caddymodule.TCPTarget{Route: h.Route, LB: h.lb}
	if sni, ok := cx.Replacer().GetString("l4.tls.server_name"); ok {
		target.ServerName = sni
	}
	// The port Caddy accepted on: after proxy_protocol, cx.LocalAddr is
	// the header's destination (the front end's port, say 6379 where
	// this server listens on 16379), which must not pick the route.
	if a, ok := (conn{cx}).NetConn().LocalAddr().(*net.TCPAddr); ok {
		target.LocalPort = uint32(a.Port)
	}
	return h.relayError(h.relay(conn{cx}, target), target, cx.RemoteAddr().String())
}

// handleUDP carries the datagrams of the client address cx stands for (a
// UDP server hands each address a connection of its own, each Read one
// datagram) in a datagram flow, until the flow ends (the route's idle
// timeout, the agent's end) or the server's idle_timeout ends cx.
func (h *Handler) handleUDP(cx *layer4.Connection, local *net.UDPAddr) error {
	target := caddymodule.UDPTarget{Route: h.Route, LocalPort: uint32(local.Port), LB: h.lb}
	err := h.relayUDP(udpConn{cx}, target)
	return h.relayError(err, caddymodule.TCPTarget{Route: target.Route, LocalPort: target.LocalPort}, cx.RemoteAddr().String())
}

// udpConn is a UDP server's connection for one client address, whose
// Close the relay may call to end its reads: caddy-l4 closes the
// connection itself once the handler returns, and a second Close would
// reach its server as the close of the next connection of the same
// address (its close notice names the address alone). Close ends the
// reads with a deadline instead.
type udpConn struct{ net.Conn }

func (c udpConn) Close() error { return c.SetReadDeadline(time.Now()) }

// relayError is what Handle returns for the relay's result err. caddy-l4
// logs a handler's error at ERROR level, once per connection ("handling
// connection"), so it gets only real failures (the agent refused or could
// not dial, its session ended mid-stream, an upstream reset), wrapped with
// the connection's route. Not failures: the client hanging up, which is how
// a connection ends (clientGone); a connection no agent serves, logged here
// at WARN, throttled; one refused by allowed_cidrs or a connection limit,
// which the node logged, throttled.
func (h *Handler) relayError(err error, target caddymodule.TCPTarget, remote string) error {
	switch {
	case tunnelFailed(err):
		// Before clientGone: a session's end wraps its cause, io.EOF say.
	case err == nil, clientGone(err), errors.Is(err, caddymodule.ErrForbidden), errors.Is(err, caddymodule.ErrLimit):
		return nil
	case errors.Is(err, caddymodule.ErrNoRoute):
		if ok, suppressed := h.noRoute.Allow(); ok {
			h.logger.Warn("no agent serves connection; closed",
				zap.String("route", target.Route), zap.String("server_name", target.ServerName),
				zap.Uint32("local_port", target.LocalPort), zap.String("remote", remote),
				zap.Int("suppressed", suppressed))
		}
		return nil
	}
	return fmt.Errorf("sluice: relaying the connection of %s (route %q, server name %q, local port %d): %w",
		remote, target.Route, target.ServerName, target.LocalPort, err)
}

// tunnelFailed reports whether err is the tunnel's side failing: the
// agent aborted the connection (refused it, could not dial, its upstream
// reset it) or the session ended under it.
func tunnelFailed(err error) bool {
	return errors.Is(err, tunnelcore.ErrConnReset) || errors.Is(err, tunnelcore.ErrSessionClosed)
}

// clientGone reports whether err is the client's side of the connection
// ending: a reset or broken pipe of its socket, a read past its close, the
// server's idle_timeout. The tunnel's side mostly fails with tunnelcore's
// errors instead (a peer's Error, the session's end); the rare failure of
// its own that looks like these (a direct socket's reset) goes unlogged
// here.
func clientGone(err error) bool {
	for _, gone := range []error{io.EOF, io.ErrUnexpectedEOF, net.ErrClosed, os.ErrDeadlineExceeded,
		syscall.ECONNRESET, syscall.EPIPE, syscall.ECONNABORTED} {
		if errors.Is(err, gone) {
			return true
		}
	}
	return false
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	sluice [<route>] {
//		lb_policy first|round_robin|random|least_conn
//	}
//
// With no route, the connection goes to the route serving the TLS server
// name a `tls` matcher or handler saw, else to the listen-port route of the
// port the client connected to. On a UDP server (`udp/:53`) the route is a
// udp:// one: by name, else by the port.
//
// lb_policy chooses among the agents serving the route (see
// Handler.LBPolicy); the default is first. The block is optional.
func (h *Handler) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // handler name
	if d.NextArg() {
		h.Route = d.Val()
	}
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		switch d.Val() {
		case "lb_policy":
			if h.LBPolicy != "" {
				return d.Err("sluice: lb_policy given twice")
			}
			if !d.NextArg() {
				return d.ArgErr()
			}
			h.LBPolicy = d.Val()
			if d.NextArg() {
				return d.ArgErr()
			}
			if err := caddymodule.ValidLBPolicy(h.LBPolicy); err != nil {
				return d.Errf("sluice: lb_policy: %v", err)
			}
		default:
			return d.Errf("sluice: unrecognized option %q", d.Val())
		}
	}
	return nil
}

// conn gives a *layer4.Connection half-close: the relay closes its write
// side when the agent's side ends, and the client may still send. Reads go
// through the Connection so bytes matchers peeked are replayed.
type conn struct{ *layer4.Connection }

// CloseWrite half-closes the client connection. Handlers before sluice wrap
// it (proxy_protocol in a *proxyproto.Conn, which cannot half-close, inside
// a *layer4.Connection), so it looks through wrappers for the first
// connection that can: a *tls.Conn (close_notify) or the *net.TCPConn.
// Without this a half-close after proxy_protocol closed both directions.
func (c conn) CloseWrite() error {
	nc := c.find(func(nc net.Conn) bool { _, ok := nc.(interface{ CloseWrite() error }); return ok })
	if cw, ok := nc.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errors.New("connection cannot half-close")
}

// NetConn returns the TCP connection under the layer4 wrappers (the
// innermost connection when there is none to find), so that a relay passing
// an upstream's reset on can reset the client's connection
// (tunnelcore.Relay).
func (c conn) NetConn() net.Conn {
	return c.find(func(nc net.Conn) bool { _, ok := nc.(*net.TCPConn); return ok })
}

// find looks through the wrappers around the client connection, outermost
// first, for the first one that is what it wants, and returns it, or the
// innermost connection it reached.
func (c conn) find(want func(net.Conn) bool) net.Conn {
	nc := c.Connection.Conn
	for range 16 {
		if want(nc) {
			return nc
		}
		switch x := nc.(type) {
		case *layer4.Connection:
			nc = x.Conn
		case interface{ Raw() net.Conn }: // *proxyproto.Conn
			nc = x.Raw()
		case interface{ NetConn() net.Conn }: // *tls.Conn
			nc = x.NetConn()
		default:
			return nc
		}
	}
	return nc
}

// Interface guards
var (
	_ caddy.Provisioner     = (*Handler)(nil)
	_ layer4.NextHandler    = (*Handler)(nil)
	_ caddyfile.Unmarshaler = (*Handler)(nil)
)

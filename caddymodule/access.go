package caddymodule

import (
	"errors"
	"net"
	"net/http"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/hostname"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Request placeholders naming who served an HTTP request through the
// tunnel, for Caddy's own access log (`log_append agent
// {http.sluice.agent}`): set by the sluice transport on every round trip
// it makes, so when reverse_proxy retries on another agent the last one
// wins. Unset when no agent served the request (a 503 of the handler).
const (
	placeholderAgent     = "http.sluice.agent"
	placeholderRoute     = "http.sluice.route"
	placeholderTransport = "http.sluice.transport"
)

// Values of the transport placeholder and of the access line's field:
// how the served connection crossed the tunnel.
const (
	transportGRPC   = "grpc"   // frames on the agent's gRPC stream
	transportLane   = "lane"   // frames on the agent's data lane
	transportDirect = "direct" // the connection's own socket (moved off the lane)
)

// sessionTransport names the transport a's session runs on.
func sessionTransport(a *agentSession) string {
	if a.lane {
		return transportLane
	}
	return transportGRPC
}

// connTransport names how c crossed the tunnel: its own direct socket, or
// its session's transport.
func connTransport(a *agentSession, c *tunnelcore.Conn) string {
	if c != nil && c.Direct() {
		return transportDirect
	}
	return sessionTransport(a)
}

// setServedBy sets the request placeholders for route e on the request's
// replacer (caddyhttp puts one in every request's context). The transport
// is the session's (grpc or lane): a pooled connection may move to a
// direct socket after the request, so the access line of a TCP relay (and
// sluice_direct_sockets) are where direct sockets show. The values are
// boxed once, when the session and route are admitted: nothing here
// allocates.
func setServedBy(req *http.Request, e *routeEntry) {
	repl, ok := req.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
	if !ok {
		return
	}
	repl.Set(placeholderAgent, e.agent.idValue)
	repl.Set(placeholderRoute, e.nameValue)
	if e.agent.lane {
		repl.Set(placeholderTransport, transportLane)
	} else {
		repl.Set(placeholderTransport, transportGRPC)
	}
}

// tunnelConn returns the virtual connection under nc (a *tls.Conn to an
// upstream over TLS wraps it), or nil.
func tunnelConn(nc net.Conn) *tunnelcore.Conn {
	for nc != nil {
		switch x := nc.(type) {
		case *tunnelcore.Conn:
			return x
		case interface{ NetConn() net.Conn }: // *tls.Conn
			nc = x.NetConn()
		default:
			return nil
		}
	}
	return nil
}

// Outcomes of the TCP access line: a small fixed set, for log queries.
const (
	accessOK            = "ok"             // both directions ended cleanly
	accessNoRoute       = "no_route"       // no agent serves the connection
	accessForbidden     = "forbidden"      // the route's allowed_cidrs exclude the client
	accessLimit         = "limit"          // a connection limit of the node or the agent
	accessOpenFailed    = "open_failed"    // the session ended before the connection opened
	accessAgentRefused  = "agent_refused"  // the agent refused the connection (route not served)
	accessDialFailed    = "dial_failed"    // the agent could not reach its upstream
	accessIdleTimeout   = "idle_timeout"   // no byte either way for the route's idle timeout
	accessUpstreamReset = "upstream_reset" // the agent's side aborted mid-stream
	accessTunnelError   = "tunnel_error"   // the session ended under the connection
	accessClientReset   = "client_reset"   // the client's side failed (reset, broken pipe)
)

// accessLogName is the logger the TCP access lines go to, under the sluice
// app's logger: `log { include sluice.access }` picks them, `exclude
// sluice.access` leaves them out.
const accessLogName = "access"

// tcpAccess is what one TCP connection's access line says.
type tcpAccess struct {
	start      time.Time
	client     string
	serverName string
	route      string
	agent      *agentSession
	conn       *tunnelcore.Conn // nil until opened
	fromClient int64
	toClient   int64
	idle       atomic.Bool // watchIdle closed the relay
	outcome    string      // set when known before the relay's error is read
}

// served records the route and virtual connection that carried it.
func (x *tcpAccess) served(e *routeEntry, up *tunnelcore.Conn, res tunnelcore.RelayResult) {
	x.route, x.agent, x.conn = routeName(e.route), e.agent, up
	x.fromClient, x.toClient = res.AToB, res.BToA
}

// logTCPAccess writes the access line of a TCP connection that ended with
// err, through the throttle.
func (n *node) logTCPAccess(x *tcpAccess, err error) {
	ok, suppressed := n.accessLog.Allow()
	if !ok {
		return
	}
	fields := []zap.Field{
		zap.String("client", x.client), zap.String("route", x.route), zap.String("server_name", truncate(x.serverName, hostname.MaxLength)),
		zap.String("agent", agentID(x.agent)), zap.String("transport", x.transport()),
		zap.Int64("bytes_from_client", x.fromClient), zap.Int64("bytes_to_client", x.toClient),
		zap.Duration("duration", time.Since(x.start)), zap.String("outcome", x.outcomeOf(err)),
		zap.Int("suppressed_since_last", suppressed),
	}
	if err != nil {
		fields = append(fields, zap.Error(err))
	}
	n.log().Named(accessLogName).Info("tcp connection", fields...)
}

func agentID(a *agentSession) string {
	if a == nil {
		return ""
	}
	return a.agentID
}

func (x *tcpAccess) transport() string {
	if x.agent == nil {
		return ""
	}
	return connTransport(x.agent, x.conn)
}

// outcomeOf names how the connection ended.
func (x *tcpAccess) outcomeOf(err error) string {
	if x.outcome != "" {
		return x.outcome
	}
	if x.idle.Load() {
		return accessIdleTimeout
	}
	return tcpOutcome(err)
}

// tcpOutcome classifies a relay's error.
func tcpOutcome(err error) string {
	var pe *tunnelcore.PeerError
	switch {
	case err == nil:
		return accessOK
	case errors.Is(err, ErrNoRoute), errors.Is(err, errAgentLeft):
		return accessNoRoute
	case errors.Is(err, ErrForbidden):
		return accessForbidden
	case errors.Is(err, ErrLimit):
		return accessLimit
	case errors.As(err, &pe):
		return peerOutcome(pe.Code)
	case errors.Is(err, tunnelcore.ErrSessionClosed):
		return accessTunnelError
	default:
		return accessClientReset
	}
}

// peerOutcome classifies the agent's Error code.
func peerOutcome(code tunnelpb.Error_Code) string {
	switch code {
	case tunnelpb.Error_DIAL_FAILED:
		return accessDialFailed
	case tunnelpb.Error_REFUSED:
		return accessAgentRefused
	case tunnelpb.Error_RESOURCE_EXHAUSTED:
		return accessLimit
	default:
		return accessUpstreamReset
	}
}

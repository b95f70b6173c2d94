package caddymodule

import (
	"sync/atomic"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// connTotals is what the node keeps of the virtual connections that
// ended: the one place (connEnded, the sessions' tunnelcore
// Config.OnConnEnd) where every connection, HTTP or TCP, reports its
// route, agent, client, bytes each way, duration and outcome. Metrics and
// access lines hang off it without touching the core.
type connTotals struct {
	ended     atomic.Int64 // connections that ended, any outcome
	failed    atomic.Int64 // of those, not closed cleanly
	fromAgent atomic.Int64 // bytes read from agents (to clients)
	toAgent   atomic.Int64 // bytes written to agents (from clients)
}

// connKind names what a virtual connection carried, for log lines.
func connKind(info tunnelcore.ConnectInfo) string {
	if h, ok := info.Tag.(*httpConn); ok {
		if h.upgraded.Load() {
			return "http_upgraded"
		}
		return "http"
	}
	return "tcp"
}

// connEnded accounts for a virtual connection of a's session that ended.
// It runs once per connection, off the session's locks.
func (n *node) connEnded(a *agentSession, e tunnelcore.ConnEnd) {
	t := &n.conns
	t.ended.Add(1)
	if e.Outcome != tunnelcore.ConnClosed {
		t.failed.Add(1)
	}
	t.fromAgent.Add(e.Read)
	t.toAgent.Add(e.Written)
	a.endedToClients.Add(e.Read)
	a.endedFromClients.Add(e.Written)
	n.metrics.connEnded(e)
	if ce := n.log().Check(zap.DebugLevel, "tunnel connection ended"); ce != nil {
		ce.Write(zap.String("agent", a.agentID), zap.String("route", e.Info.RouteKey), zap.String("kind", connKind(e.Info)),
			zap.String("client", e.Info.RemoteAddr), zap.Int64("bytes_to_client", e.Read), zap.Int64("bytes_from_client", e.Written),
			zap.Duration("duration", e.Duration), zap.Bool("direct", e.Direct), zap.Stringer("outcome", e.Outcome), zap.Error(e.Err))
	}
}

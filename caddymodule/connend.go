package caddymodule

import (
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// connKindOf says what a virtual connection carried: an index into
// connKindNames (http, http_upgraded, tcp).
func connKindOf(info tunnelcore.ConnectInfo) int {
	if info.Datagram {
		return 3
	}
	if h, ok := info.Tag.(*httpConn); ok {
		if h.upgraded.Load() {
			return 1
		}
		return 0
	}
	return 2
}

// connEnded accounts for a virtual connection of a's session that ended:
// the one place (the sessions' tunnelcore Config.OnConnEnd) where every
// connection, HTTP or TCP, reports its route, agent, client, bytes each
// way, duration and outcome. The node's counters per route (metrics.go)
// are its totals too (nodeCounters.totals); metrics and access lines hang
// off it without touching the core. It runs once per connection, off the
// session's locks.
func (n *node) connEnded(a *agentSession, e tunnelcore.ConnEnd) {
	a.endedToClients.Add(e.Read)
	a.endedFromClients.Add(e.Written)
	n.metrics.connEnded(e)
	if ce := n.log().Check(zap.DebugLevel, "tunnel connection ended"); ce != nil {
		ce.Write(zap.String("agent", a.agentID), zap.String("route", e.Info.RouteKey), zap.String("kind", connKindNames[connKindOf(e.Info)]),
			zap.String("client", e.Info.RemoteAddr), zap.Int64("bytes_to_client", e.Read), zap.Int64("bytes_from_client", e.Written),
			zap.Duration("duration", e.Duration), zap.Bool("direct", e.Direct), zap.Stringer("outcome", e.Outcome), zap.Error(e.Err))
	}
}

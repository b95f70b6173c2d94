package caddymodule

import (
	"errors"
	"fmt"
	"slices"
	"unicode/utf8"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// names lists the route names for a log line: the first maxLoggedRoutes,
// then how many more.
func names(es []*routeEntry) []string {
	out := make([]string, 0, min(len(es), maxLoggedRoutes+1))
	for i, e := range es {
		if i == maxLoggedRoutes {
			out = append(out, fmt.Sprintf("(%d more)", len(es)-i))
			break
		}
		out = append(out, routeName(e.route))
	}
	return out
}

// What an agent may put in the node's log lines is bounded: its id
// (ident.CheckID, as the agent itself enforces), its build string, the
// routes listed, the text of its Error frames.
const (
	maxBuildLength   = 256
	maxLoggedRoutes  = 32
	maxLoggedMessage = 256
)

// truncate shortens s to at most n bytes, marking the cut.
func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return cutUTF8(s, n) + "…"
}

// cutUTF8 returns the longest prefix of s of at most n bytes that does not
// split a UTF-8 character: strings the node sends go into proto string
// fields, which must stay valid UTF-8 (a frame that does not marshal ends
// the session).
func cutUTF8(s string, n int) string {
	if len(s) <= n {
		return s
	}
	for n > 0 && !utf8.RuneStart(s[n]) {
		n--
	}
	return s[:n]
}

// admit validates an agent's routes and claims the ports of its listen-port
// routes. Routes it cannot take are returned as rejected, with the reason.
func (n *node) admit(a *agentSession, routes []*tunnelpb.Route, previous []*routeEntry) ([]*routeEntry, []*tunnelpb.RejectedRoute) {
	entries, rejected := validateRoutes(routes)
	n.metrics.rejectRoutes(rejectInvalid, len(rejected))
	entries, outOfScope := n.admitScoped(a, entries)
	rejected = append(rejected, outOfScope...)
	entries, overBudget := n.reg.bind(a, entries, previous)
	n.metrics.rejectRoutes(rejectPatternBudget, len(overBudget))
	rejected = append(rejected, overBudget...)
	opts := n.opts.Load()
	kept := entries[:0]
	for _, e := range entries {
		pm := n.portsOf(e.kind)
		if pm == nil {
			kept = append(kept, e)
			continue
		}
		if err := pm.claim(e, opts); err != nil && !errors.Is(err, errNotBound) {
			rejected = append(rejected, &tunnelpb.RejectedRoute{Name: routeName(e.route), ListenPort: e.route.GetListenPort(), Reason: err.Error()})
			n.metrics.rejectRoutes(rejectPort, 1)
			if ok, suppressed := n.portLog.Allow(); ok {
				n.log().Warn("agent port route rejected", zap.String("agent", a.agentID), zap.Uint32("port", e.route.GetListenPort()),
					zap.Error(err), zap.Int("suppressed_since_last", suppressed))
			}
			continue
		}
		kept = append(kept, e)
	}
	return kept, rejected
}

// readmitLocked replaces a registered session's routes with routes (a
// repeated Advertise, or its last one again after a reload changed the port
// options) and answers with a fresh AdvertiseAck. The agent retries what
// is rejected with its backoff. Callers hold admitMu.
func (n *node) readmitLocked(a *agentSession, routes []*tunnelpb.Route) {
	select {
	case <-a.sess.Done():
		// An Advertise dispatched as the session ended: its end released
		// the ports and routes already (under admitMu), and claiming them
		// again would bind ports to a dead session for good.
		return
	default:
	}
	if a.leaving.Load() {
		// The agent is shutting down (leave): its routes stay withdrawn,
		// also when a reload re-admits the port routes of every session.
		return
	}
	a.advertised = routes
	old := a.currentRoutes(&n.reg.mu)
	entries, rejected := n.admit(a, routes, old)
	n.reg.reroute(a, entries)
	n.releasePorts(old) // after the new claims, so a re-claimed port stays bound
	n.sendAck(a, rejected)
	n.noticeOverlapsLocked(a, old, entries)
}

// applyPortOptions re-admits the listen-port routes when the port options
// changed from old to new in a way that matters: a different range, or a
// different tcp_bind (udp_bind) while a range is set (without one nothing
// is bound).
func (n *node) applyPortOptions(old, new *nodeOptions) {
	rangeChanged := old.portRange != new.portRange || old.udp.portRange != new.udp.portRange
	rebind := old.tcpBind != new.tcpBind && (old.portRange.lo != 0 || new.portRange.lo != 0)
	rebindUDP := old.udp.bind != new.udp.bind && (old.udp.portRange.lo != 0 || new.udp.portRange.lo != 0)
	if rangeChanged || rebind || rebindUDP {
		n.portOptionsChanged(rebind, rebindUDP)
	}
}

// portsOf is the port manager of the listen-port routes of kind k, nil
// for the other kinds.
func (n *node) portsOf(k route.Kind) *portManager {
	switch k {
	case route.ListenPort:
		return n.ports
	case route.UDPListenPort:
		return n.udp.ports
	}
	return nil
}

// portOptionsChanged re-admits the listen-port routes of every session
// after a reload changed tcp_port_range, tcp_bind or their UDP twins: ports the new range
// excludes are released (connections already relayed keep running) and
// reported rejected to their agents, ports it now includes are bound at
// once, and a new tcp_bind (udp_bind) rebinds every TCP (UDP) port.
// Sessions without listen-port routes are left alone, their pooled
// connections with them.
func (n *node) portOptionsChanged(rebind, rebindUDP bool) {
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	sessions := n.reg.sessions()
	if rebind {
		n.ports.closeAll()
	}
	if rebindUDP {
		n.udp.ports.closeAll()
	}
	if rebind || rebindUDP {
		// Largest agent id first: a port's smaller ids then join the
		// claim as its owner, and the larger ones stay as standbys (a
		// claim refuses a larger id only once a smaller one holds it).
		slices.SortFunc(sessions, func(x, y *agentSession) int { return compareAgents(y, x) })
	}
	readmitted := 0
	for _, a := range sessions {
		// The advertised routes, rejected ones included: a port the old
		// range refused may be in the new one.
		if slices.ContainsFunc(a.advertised, func(r *tunnelpb.Route) bool { return r.GetListenPort() != 0 }) {
			n.readmitLocked(a, a.advertised)
			readmitted++
		}
	}
	if readmitted > 0 {
		n.log().Info("port options changed; agent port routes re-admitted", zap.Int("sessions", readmitted))
	}
}

// releasePorts gives up the port claims of routes.
func (n *node) releasePorts(routes []*routeEntry) {
	for _, e := range routes {
		if pm := n.portsOf(e.kind); pm != nil {
			pm.release(e)
		}
	}
}

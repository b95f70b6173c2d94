package caddymodule

import (
	"fmt"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// reasonOutOfScope starts the AdvertiseAck reason of a route its
// credential's scope does not allow: agents recognise it and do not
// retry (only a reload changes a scope, and the node re-admits then).
const reasonOutOfScope = "out_of_scope"

// admitScope checks a route against the scope of its session's
// credential; nil scope (the unscoped token) allows every route. A
// pattern route that is allowed is also bound to the scope's names
// (routeEntry.within), so it only ever matches hosts of its credential.
// It returns the rejection reason, "" when the route is in scope.
func (sc *scope) admitScope(e *routeEntry) string {
	if sc == nil {
		return ""
	}
	rt := e.route
	switch e.kind {
	case route.Host, route.TCPHost:
		if h := strings.ToLower(rt.GetHost()); !sc.hosts.contains(h) {
			return fmt.Sprintf("host %q is not among its hosts", h)
		}
	case route.HostPattern, route.TCPHostPattern:
		return sc.admitPattern(e, &sc.hosts, "hosts")
	case route.PassthroughHost:
		if h := strings.ToLower(rt.GetHost()); !sc.serverNames.contains(h) {
			return fmt.Sprintf("TLS server name %q is not among its server_names", h)
		}
	case route.PassthroughPattern:
		return sc.admitPattern(e, &sc.serverNames, "server_names")
	case route.CatchAll:
		if !sc.catchAll {
			return "the catch-all route is not allowed (allow_catch_all)"
		}
	case route.NamedTCP:
		if name := routeName(rt); !sc.anyService && !sc.services[name] {
			return fmt.Sprintf("TCP service %q is not among its services", name)
		}
	case route.ListenPort, route.UDPListenPort:
		if p := rt.GetListenPort(); !sc.ports.contains(p) {
			return fmt.Sprintf("listen port %d is outside its ports %s", p, sc.ports)
		}
	case route.NamedUDP:
		if name := routeName(rt); !sc.anyService && !sc.services[name] {
			return fmt.Sprintf("UDP service %q is not among its services", name)
		}
	default:
		// A kind added later is refused until its scope rule is written.
		return fmt.Sprintf("%s routes are not allowed to scoped credentials", e.kind)
	}
	return ""
}

// admitPattern allows a pattern route when the scope allows patterns and
// names for them to match, and bounds it to those names.
func (sc *scope) admitPattern(e *routeEntry, names *nameSet, field string) string {
	switch {
	case !sc.patterns:
		return "host patterns are not allowed (allow_patterns)"
	case names.empty():
		return fmt.Sprintf("host patterns need %s to match within", field)
	}
	e.within = names
	return ""
}

// reachableByName drops, from the routes with one name, those whose
// credential's services do not have the name: an agent names its routes
// as it likes, and a host route named "postgres" must not take the
// clients of layer4's `sluice postgres`. It allocates only when it drops.
func reachableByName(es []*routeEntry) []*routeEntry {
	for i, e := range es {
		if e.nameOutOfScope {
			out := slices.Clone(es[:i])
			for _, e := range es[i+1:] {
				if !e.nameOutOfScope {
					out = append(out, e)
				}
			}
			return out
		}
	}
	return es
}

// inScope reports whether a pattern route may serve host: always, unless
// its credential's scope bounds it (within).
func (e *routeEntry) inScope(host string) bool {
	return e.within == nil || e.within.contains(host)
}

// admitScoped keeps the entries a's credential's scope allows and returns
// the others rejected with reason out_of_scope, logged through a throttle.
// Callers hold admitMu (a.auth).
func (n *node) admitScoped(a *agentSession, entries []*routeEntry) (kept []*routeEntry, rejected []*tunnelpb.RejectedRoute) {
	sc := a.scope()
	if sc == nil {
		return entries, nil
	}
	kept = entries[:0]
	for _, e := range entries {
		reason := sc.admitScope(e)
		if reason == "" {
			e.nameOutOfScope = !sc.anyService && !sc.services[routeName(e.route)]
			kept = append(kept, e)
			continue
		}
		name := routeName(e.route)
		rejected = append(rejected, &tunnelpb.RejectedRoute{Name: name, ListenPort: e.route.GetListenPort(),
			Reason: fmt.Sprintf("%s: %s of credential %q", reasonOutOfScope, reason, a.credName)})
		if ok, suppressed := n.scopeLog.Allow(); ok {
			n.log().Warn("agent route outside its credential's scope rejected", zap.String("agent", a.agentID),
				zap.String("credential", a.credName), zap.String("route", name), zap.String("reason", reason),
				zap.Int("suppressed_since_last", suppressed))
		}
	}
	n.metrics.rejectRoutes(rejectOutOfScope, len(rejected))
	return kept, rejected
}

// scope is the scope of a's credential; nil: unscoped. Every session
// the handshake registers has a credential (identify); sessions built
// without one exist only in unit tests. Callers hold admitMu.
func (a *agentSession) scope() *scope {
	if a.auth.cred == nil {
		return nil
	}
	return a.auth.cred.scope
}

// sharing returns the routes of the table reached the way e is (the same
// host, server name, pattern, service name, port, or the catch-all), in
// routing order, e included when it is in the table.
func (t *routeTable) sharing(e *routeEntry) []*routeEntry {
	rt := e.route
	switch e.kind {
	case route.Host, route.TCPHost:
		return t.exact.get(strings.ToLower(rt.GetHost()))
	case route.PassthroughHost:
		return t.sniExact.get(strings.ToLower(rt.GetHost()))
	case route.HostPattern, route.TCPHostPattern, route.PassthroughPattern:
		return t.bySource[patternKey(e)]
	case route.CatchAll:
		return t.catchAll
	case route.NamedTCP:
		return t.byName.get(routeName(rt))
	case route.ListenPort:
		return t.byPort.get(rt.GetListenPort())
	case route.NamedUDP:
		return kindOnly(t.byName.get(routeName(rt)), route.NamedUDP)
	case route.UDPListenPort:
		return t.byUDPPort.get(rt.GetListenPort())
	}
	return nil
}

// patternKey groups the pattern routes that match the same names the same
// way: the same pattern, for HTTP or for TLS passthrough.
func patternKey(e *routeEntry) string {
	return strconv.FormatBool(e.kind == route.PassthroughPattern) + e.pattern.source
}

// overlapsOf returns the routes of a that agents of other credentials
// serve too, as the table t has them, in a's route order.
func overlapsOf(t *routeTable, a *agentSession) []*tunnelpb.RouteOverlap {
	var out []*tunnelpb.RouteOverlap
	for _, e := range a.routes {
		shared := t.sharing(e)
		self := slices.Index(shared, e)
		if self < 0 {
			continue // not in the table (a leaving session's)
		}
		for i, o := range shared {
			if o.agent.credName == a.credName {
				continue
			}
			out = append(out, &tunnelpb.RouteOverlap{Name: routeName(e.route), OtherCredential: o.agent.credName,
				OtherAgentId: o.agent.agentID, Shadowed: i < self})
		}
	}
	return out
}

// overlapsKey is a list of overlaps as one comparable string.
func overlapsKey(os []*tunnelpb.RouteOverlap) string {
	var b strings.Builder
	for _, o := range os {
		fmt.Fprintf(&b, "%q %q %q %t\n", o.GetName(), o.GetOtherCredential(), o.GetOtherAgentId(), o.GetShadowed())
	}
	return b.String()
}

// noticeOverlapsLocked tells the sessions whose overlaps with other
// credentials' agents changed, when the routes touched (those of a session
// that registered, re-advertised, left or ended) changed in the table:
// each gets a fresh AdvertiseAck, and a route that became shadowed is
// logged. skip already got its ack. Only the sessions sharing a touched
// route are looked at, so a registration costs what it touches, not the
// node's whole table. Callers hold admitMu.
func (n *node) noticeOverlapsLocked(skip *agentSession, touched ...[]*routeEntry) {
	t := n.reg.table.Load()
	seen := map[*agentSession]bool{skip: true}
	for _, routes := range touched {
		for _, e := range routes {
			for _, o := range t.sharing(e) {
				if !seen[o.agent] {
					seen[o.agent] = true
					n.refreshOverlaps(t, o.agent)
				}
			}
		}
	}
}

// refreshOverlaps sends a a fresh AdvertiseAck when its overlaps changed.
func (n *node) refreshOverlaps(t *routeTable, a *agentSession) {
	if overlapsKey(overlapsOf(t, a)) != a.overlaps {
		n.sendAck(a, a.rejected)
	}
}

// logShadowed logs the overlaps of a that are new since its last ack and
// in which a is shadowed: both sides are told in their acks, the log says
// it once per pair.
func (n *node) logShadowed(a *agentSession, overlaps []*tunnelpb.RouteOverlap, before string) {
	for _, o := range overlaps {
		if !o.GetShadowed() || strings.Contains(before, overlapsKey([]*tunnelpb.RouteOverlap{o})) {
			continue
		}
		if ok, suppressed := n.scopeLog.Allow(); ok {
			n.log().Warn("route served by agents of two credentials: the first in routing order shadows the other",
				zap.String("route", o.GetName()), zap.String("agent", a.agentID), zap.String("credential", a.credName),
				zap.String("shadowed_by_agent", o.GetOtherAgentId()), zap.String("shadowed_by_credential", o.GetOtherCredential()),
				zap.Int("suppressed_since_last", suppressed))
		}
	}
}

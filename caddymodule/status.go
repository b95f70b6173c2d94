package caddymodule

import (
	"slices"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"

	"github.com/sluice-tunnel/sluice/internal/route"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// This file is the read-only view of a node that the admin API
// (adminapi.go) and the sluice_health handler (health.go) share: a
// snapshot of its state, readiness, and route lookups that read the
// route table and nothing else. Nothing here takes a selection of a
// load-balancing policy or moves a counter, so an operator asking which
// agent serves a host never changes which agent does; and nothing here
// carries a token or a target's credentials.

// NodeStatus is one node (one control address of the process) as
// `GET /sluice/status` reports it.
type NodeStatus struct {
	// ID names the node (nodeID).
	ID string `json:"id"`
	// Listen is the control address the config gives, Address the one the
	// listener is bound to (empty until it serves).
	Listen  string `json:"listen"`
	Address string `json:"address,omitempty"`
	TLS     bool   `json:"tls"`
	// Ready and Reason are readiness (GET /sluice/ready).
	Ready    bool   `json:"ready"`
	Reason   string `json:"reason,omitempty"`
	Draining bool   `json:"draining"`
	// ServingSince is when the control listener started serving (absent
	// before); a reload keeps it, and the warm-up with it.
	ServingSince time.Time `json:"serving_since,omitzero"`
	// Warmup is the configured warm-up ("2s"; absent: none). WarmingUp:
	// readiness is down for it until WarmupEnds.
	Warmup     string    `json:"warmup,omitempty"`
	WarmingUp  bool      `json:"warming_up"`
	WarmupEnds time.Time `json:"warmup_ends,omitzero"`
	// Members are the cluster's members, as agents are told of them
	// (absent without a cluster).
	Members []MemberStatus `json:"members,omitempty"`
	Limits  LimitsStatus   `json:"limits"`
	Totals  TotalsStatus   `json:"totals"`
	// Sessions are the agents' sessions by agent id, leaving ones
	// included.
	Sessions []SessionStatus `json:"sessions"`
	// Ports are the ports the node binds for listen-port routes
	// (tcp_port_range).
	Ports []PortStatus `json:"ports"`
}

// MemberStatus is one member of the node's cluster.
type MemberStatus struct {
	ID string `json:"id"`
	// URL is where agents dial it; empty: where they reached the node
	// that told them (this node's own entry, unless configured).
	URL string `json:"url,omitempty"`
	// Local: the member is this node.
	Local bool `json:"local,omitempty"`
}

// Usage is one limit and how much of it is taken. A Limit of 0 is no
// limit.
type Usage struct {
	Limit int64 `json:"limit"`
	InUse int64 `json:"in_use"`
}

// LimitsStatus is the node's limits as the running config sets them, and
// their use.
type LimitsStatus struct {
	MaxConnections       Usage  `json:"max_connections"`
	TunnelBudget         Usage  `json:"tunnel_budget"`
	MaxSessions          Usage  `json:"max_sessions"`
	MaxPendingStreams    Usage  `json:"max_pending_streams"`
	PendingConnections   int    `json:"pending_connections"` // control connections not authenticated yet
	MaxConnsPerAddress   int    `json:"max_connections_per_address"`
	MaxSessionsPerAddr   int    `json:"max_sessions_per_address"`
	MaxPendingPerAddress int    `json:"max_pending_streams_per_address"`
	TCPPortRange         string `json:"tcp_port_range"`
}

// TotalsStatus is what the node counted since it started.
type TotalsStatus struct {
	Refused           int64 `json:"refused"`
	AwaitingAgent     int64 `json:"awaiting_agent"`
	AuthFailures      int64 `json:"auth_failures"`
	ConnectionsEnded  int64 `json:"connections_ended"`
	ConnectionsFailed int64 `json:"connections_failed"`
	BytesToClients    int64 `json:"bytes_to_clients"`
	BytesFromClients  int64 `json:"bytes_from_clients"`
}

// SessionStatus is one agent session.
type SessionStatus struct {
	AgentID string `json:"agent_id"`
	// Credential is the name of the credential the agent authenticated
	// with; "" for the node's unscoped token.
	Credential     string    `json:"credential"`
	Build          string    `json:"build,omitempty"`
	Remote         string    `json:"remote"`
	ConnectedSince time.Time `json:"connected_since"`
	// Transport is how the session's frames travel, as the access log
	// names it (access.go's sessionTransport): grpc, lane, or tunnel when
	// the session does not say. DirectSockets: bulk connections may move
	// to sockets of their own (a lane session offered them).
	Transport     string `json:"transport"`
	DirectSockets bool   `json:"direct_sockets"`
	// Leaving: the agent is shutting down; its routes take nothing new.
	Leaving     bool          `json:"leaving"`
	Connections int           `json:"connections"`
	Buffered    int64         `json:"buffered"`
	Queued      int64         `json:"queued"`
	Direct      int64         `json:"direct_connections"` // given a direct socket so far
	Routes      []RouteStatus `json:"routes"`
}

// RouteStatus is one admitted route. The target is left out: it is the
// agent's business, and a URL may carry credentials.
type RouteStatus struct {
	Name           string   `json:"name"`
	Kind           string   `json:"kind"` // route.Kind's name
	Host           string   `json:"host,omitempty"`
	HostPattern    string   `json:"host_pattern,omitempty"`
	ListenPort     uint32   `json:"listen_port,omitempty"`
	TLSPassthrough bool     `json:"tls_passthrough,omitempty"`
	AllowedCIDRs   []string `json:"allowed_cidrs,omitempty"`
}

// PortStatus is one port the node binds for listen-port routes: the agent
// that owns it and those standing by, in the order they would take over.
type PortStatus struct {
	Port    uint32   `json:"port"`
	Address string   `json:"address"`
	Owner   string   `json:"owner"`
	Route   string   `json:"route"`
	Standby []string `json:"standby,omitempty"`
	// Network is "udp" for a UDP port (udp_port_range); empty for TCP.
	Network string `json:"network,omitempty"`
}

// nodeID is the node's id in the admin API: the config's node_id (the
// `node` label of its metrics; by default the host name), else, before a
// config started the node, the bound control address, else the configured
// one. The one place that decides it.
func nodeID(n *node) string {
	if id := n.opts.Load().nodeID; id != "" {
		return id
	}
	n.serveMu.Lock()
	defer n.serveMu.Unlock()
	if n.id != "" {
		return n.id
	}
	return n.addr
}

// sessions returns the sessions a direct-socket key names: those offered
// direct sockets on their lane.
func (k *directKeys) sessions() map[*tunnelcore.Session]bool {
	k.mu.Lock()
	defer k.mu.Unlock()
	out := make(map[*tunnelcore.Session]bool, len(k.m))
	for _, s := range k.m {
		out[s] = true
	}
	return out
}

// readiness reports whether n takes agents and traffic: it serves its
// control listener, its warm-up is over, and it is not draining; else why
// not.
//
// Draining includes the process exiting (caddy.Exiting): watchExit sets
// draining within its tick, but a load balancer's probe in that tick
// must already see the node going, before the HTTP servers stop. Warm-up
// is a comparison of times here, not a timer: nothing has to run for it
// to end.
func (n *node) readiness() (ready bool, reason string) {
	if n.draining.Load() || caddy.Exiting() {
		return false, reasonDraining
	}
	n.serveMu.Lock()
	state, started := n.serveState, n.started
	n.serveMu.Unlock()
	switch state {
	case serveIdle:
		return false, "control listener not serving yet"
	case serveStopped:
		return false, "control listener shut down"
	}
	if warmupLeft(started, n.opts.Load().warmup, time.Now()) > 0 {
		return false, reasonWarmingUp
	}
	return true, ""
}

// Reasons of readiness a load balancer's probe reports.
const (
	reasonDraining  = "draining"
	reasonWarmingUp = "warming up"
)

// warmupLeft is how much of warmup is left at now for a listener that
// started serving at started; 0 when none is.
func warmupLeft(started time.Time, warmup time.Duration, now time.Time) time.Duration {
	if warmup <= 0 || started.IsZero() {
		return 0
	}
	return max(started.Add(warmup).Sub(now), 0)
}

// status snapshots n.
func (n *node) status() NodeStatus {
	ready, reason := n.readiness()
	st := NodeStatus{
		ID: nodeID(n), Listen: n.addr, TLS: n.tls, Ready: ready, Reason: reason,
		Draining: n.draining.Load(), Limits: n.limitsStatus(), Totals: n.totals(),
		Sessions: []SessionStatus{}, Ports: append(n.ports.snapshot(), n.udp.ports.snapshot()...),
	}
	n.serveMu.Lock()
	if n.listener != nil {
		st.Address = n.listener.Addr().String()
	}
	started := n.started
	n.serveMu.Unlock()
	n.clusterStatus(&st, started, time.Now())
	direct := n.direct.sessions()
	for _, a := range n.reg.sessions() {
		st.Sessions = append(st.Sessions, snapshotSession(n.reg, a, direct[a.sess]))
	}
	return st
}

// clusterStatus fills in st's warm-up, for a listener that started
// serving at started, and the members.
func (n *node) clusterStatus(st *NodeStatus, started, now time.Time) {
	o := n.opts.Load()
	if !started.IsZero() {
		st.ServingSince = started.UTC()
	}
	if o.warmup > 0 {
		st.Warmup = o.warmup.String()
		if !started.IsZero() {
			st.WarmupEnds = started.Add(o.warmup).UTC()
			st.WarmingUp = warmupLeft(started, o.warmup, now) > 0
		}
	}
	if o.cluster == nil {
		return
	}
	for _, m := range o.cluster.nodes {
		st.Members = append(st.Members, MemberStatus{ID: m.GetId(), URL: m.GetUrl(), Local: m.GetId() == o.nodeID})
	}
}

func (n *node) limitsStatus() LimitsStatus {
	o := n.opts.Load()
	return LimitsStatus{
		MaxConnections:       Usage{Limit: n.slots.Limit(), InUse: n.slots.InUse()},
		TunnelBudget:         Usage{Limit: n.budget.Limit(), InUse: n.budget.InUse()},
		MaxSessions:          Usage{Limit: int64(o.maxSessions), InUse: int64(n.sessions.count())},
		MaxPendingStreams:    Usage{Limit: int64(o.maxPending), InUse: int64(n.pending.count())},
		PendingConnections:   n.guard.pendingCount(),
		MaxConnsPerAddress:   o.maxConnsPerAddr,
		MaxSessionsPerAddr:   o.maxSessionsPerAddr,
		MaxPendingPerAddress: o.maxPendingPerAddr,
		TCPPortRange:         o.portRange.String(),
	}
}

func (n *node) totals() TotalsStatus {
	c := n.metrics.totals()
	return TotalsStatus{
		Refused:           n.refused.Load(),
		AwaitingAgent:     n.awaitingAgent.Load(),
		AuthFailures:      n.authFailures.Load(),
		ConnectionsEnded:  c.ended,
		ConnectionsFailed: c.failed,
		BytesToClients:    c.toClients,
		BytesFromClients:  c.fromClients,
	}
}

// snapshotSession snapshots a; direct: its session was offered direct
// sockets.
func snapshotSession(reg *registry, a *agentSession, direct bool) SessionStatus {
	s := a.sess.Stats()
	st := SessionStatus{
		AgentID: a.agentID, Credential: a.credName, Build: a.build, Remote: a.remote, ConnectedSince: a.connected.UTC(),
		Transport: sessionTransport(a), DirectSockets: direct, Leaving: a.leaving.Load(),
		Connections: s.Conns, Buffered: s.Buffered, Queued: s.Queued, Direct: s.Direct,
		Routes: []RouteStatus{},
	}
	for _, e := range a.currentRoutes(&reg.mu) {
		st.Routes = append(st.Routes, routeStatus(e))
	}
	return st
}

func routeStatus(e *routeEntry) RouteStatus {
	rt := e.route
	return RouteStatus{
		Name: routeName(rt), Kind: e.kind.String(), Host: rt.GetHost(), HostPattern: rt.GetHostPattern(),
		ListenPort: rt.GetListenPort(), TLSPassthrough: rt.GetTlsPassthrough(), AllowedCIDRs: rt.GetAllowedCidrs(),
	}
}

// snapshot lists the bound ports by number.
func (m *portManager) snapshot() []PortStatus {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]PortStatus, 0, len(m.by))
	for _, c := range m.by {
		order := claimOrder(c)
		if len(order) == 0 {
			continue
		}
		ps := PortStatus{Port: c.port, Address: c.addr().String(), Owner: order[0].agent.agentID, Route: routeName(order[0].route)}
		if m.udp {
			ps.Network = "udp"
		}
		for _, e := range order[1:] {
			ps.Standby = append(ps.Standby, e.agent.agentID)
		}
		out = append(out, ps)
	}
	slices.SortFunc(out, func(a, b PortStatus) int { return int(a.Port) - int(b.Port) })
	return out
}

// claimOrder is c's claimants in the order they own the port: the owner
// (portClaim.owner) first, then those that would succeed it, by agent id
// and, within one id, newest claim first. Callers hold the manager's mu.
func claimOrder(c *portClaim) []*routeEntry {
	order := slices.Clone(c.claimants)
	slices.Reverse(order) // newest first, kept within one id by the stable sort
	slices.SortStableFunc(order, func(a, b *routeEntry) int { return compareAgents(a.agent, b.agent) })
	return order
}

// Lookup is which agent serves a host, server name, route name or port
// on one node now, as `GET /sluice/lookup` reports it.
type Lookup struct {
	ID     string `json:"id"` // the node's (nodeID)
	Listen string `json:"listen"`
	// Match is how the route was found: exact, pattern or catch_all (a
	// host), name, host or server_name (a route name, as layer4's
	// `sluice NAME` looks it up), server_name (a TLS server name),
	// claimed_port or port_route (a port the node binds, or one a layer4
	// server of the config serves); "none" when nothing serves it.
	Match string `json:"match"`
	// Agent and Route serve the query now under the default lb_policy
	// (`first`); another policy picks among Agent and Others. A route's
	// allowed_cidrs are not applied (the lookup has no client): a client
	// they refuse goes to the next candidate that allows it.
	Agent  string       `json:"agent,omitempty"`
	Route  *RouteStatus `json:"route,omitempty"`
	Others []Candidate  `json:"others"`
}

// Candidate is a route that could serve the query after the first.
type Candidate struct {
	Agent string      `json:"agent"`
	Route RouteStatus `json:"route"`
}

// lookupQuery is what GET /sluice/lookup asks for: one of its fields.
type lookupQuery struct {
	host, name, serverName string
	port                   uint32
}

// lookup answers q from n's current table and port claims, read only.
func (n *node) lookup(q lookupQuery) Lookup {
	t := n.reg.table.Load()
	var routes []*routeEntry
	var match string
	switch {
	case q.host != "":
		routes = t.lookupHTTP(q.host)
		match = httpMatch(routes)
	case q.name != "":
		routes, match = t.lookupName(q.name), nameMatch(t, q.name)
	case q.serverName != "":
		routes, match = t.lookupSNI(q.serverName), "server_name"
	default:
		routes, match = n.portRoutes(t, q.port)
	}
	l := Lookup{ID: nodeID(n), Listen: n.addr, Match: "none", Others: []Candidate{}}
	if len(routes) == 0 {
		return l
	}
	first := routeStatus(routes[0])
	l.Match, l.Agent, l.Route = match, routes[0].agent.agentID, &first
	for _, e := range routes[1:] {
		l.Others = append(l.Others, Candidate{Agent: e.agent.agentID, Route: routeStatus(e)})
	}
	return l
}

// httpMatch names the tier of lookupHTTP that routes came from.
func httpMatch(routes []*routeEntry) string {
	if len(routes) == 0 {
		return "none"
	}
	switch routes[0].kind {
	case route.Host, route.TCPHost:
		return "exact"
	case route.HostPattern, route.TCPHostPattern:
		return "pattern"
	}
	return "catch_all"
}

// nameMatch names the step of lookupName that finds name.
func nameMatch(t *routeTable, name string) string {
	switch {
	case len(t.byName.get(name)) > 0:
		return "name"
	case len(t.exact.get(strings.ToLower(name))) > 0:
		return "host"
	}
	return "server_name"
}

// portRoutes is what resolveTCP does for a port: the claim's owner and its
// standbys when the node binds the port, else the table's listen-port
// routes (a layer4 server of the config serves the port).
func (n *node) portRoutes(t *routeTable, port uint32) ([]*routeEntry, string) {
	m := n.ports
	m.mu.Lock()
	c := m.by[port]
	var order []*routeEntry
	if c != nil {
		order = claimOrder(c)
	}
	m.mu.Unlock()
	if len(order) > 0 {
		return order, "claimed_port"
	}
	return t.byPort.get(port), "port_route"
}

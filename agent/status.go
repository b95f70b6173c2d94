package agent

import (
	"cmp"
	"fmt"
	"strings"
	"sync"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Route acknowledgement states in Status.
const (
	AckPending  = "pending" // no session, or no AdvertiseAck yet
	AckAccepted = "accepted"
	AckRejected = "rejected"
)

// Transports of a session in Status.
const (
	TransportDataLane   = "data_lane"
	TransportGRPCStream = "grpc_stream"
)

// Status is what the agent's /status reports: its sessions with the
// nodes, its routes with the nodes' word on them, the listen ports they
// claim and the limits in use.
type Status struct {
	AgentID string `json:"agent_id"`
	Build   string `json:"build"`
	// Ready and Reason are /readyz's answer.
	Ready  bool   `json:"ready"`
	Reason string `json:"reason,omitempty"`
	// Sessions has one entry per link: per node the agent should be
	// connected to, and per node it is leaving.
	Sessions   []SessionStatus `json:"sessions"`
	Routes     []RouteStatus   `json:"routes"`
	PortClaims []PortClaim     `json:"port_claims"`
	Limits     LimitsStatus    `json:"limits"`
}

// SessionStatus is the agent's session with one node (its link).
type SessionStatus struct {
	// Server is the node's address as configured: the server setting,
	// or the member's URL from the membership.
	Server string `json:"server"`
	// URL is where the link dials now: Server, a member's URL once the
	// membership gave the node the server reached one, or an address of
	// the server's name (server_each_address).
	URL string `json:"url"`
	// Origin is how the link came to be: server, membership or dns.
	Origin string `json:"origin"`
	// State is idle, connecting, connected, retrying, draining, leaving,
	// standby or stopped; Since is when it last changed.
	State string    `json:"state"`
	Since time.Time `json:"since"`
	// NodeID is the id of the node the link last reached (a member's id
	// before that); NodeBuild is the node's AdvertiseAck's, while
	// connected (empty from nodes older than AdvertiseAck.build).
	NodeID    string `json:"node_id,omitempty"`
	NodeBuild string `json:"node_build,omitempty"`
	// Credential is the node's credential the session authenticated as,
	// from its AdvertiseAck, while connected: "(token)" for the node's
	// unscoped token (and from nodes older than credentials).
	Credential string `json:"credential,omitempty"`
	// Overlaps are the session's routes that agents of other credentials
	// serve too, as the node's latest AdvertiseAck states them; empty
	// when none does, or while not connected.
	Overlaps []OverlapStatus `json:"overlaps"`
	// Transport is data_lane or grpc_stream while connected;
	// DirectSockets whether bulk connections may move to their own socket.
	Transport     string `json:"transport,omitempty"`
	DirectSockets bool   `json:"direct_sockets"`
	// Draining: the node sent Drain and ends the session soon.
	Draining bool `json:"draining"`
	// Connections is the session's virtual connections.
	Connections int `json:"connections"`
	// Established counts the sessions the node acknowledged since the
	// link opened; Reconnects the attempts after one ended or failed.
	Established int64 `json:"established"`
	Reconnects  int64 `json:"reconnects"`
	// LastError is why the last session or attempt ended.
	LastError string `json:"last_error,omitempty"`
}

// LinkStatus is the agent's link with one node, as Links reports it.
type LinkStatus struct {
	// NodeID is the id of the node the link last reached, or the
	// member's id before that; "" before the server's link reached one.
	NodeID string
	// URL is where the link dials (see SessionStatus.URL).
	URL string
	// Origin is server, membership or dns (see SessionStatus.Origin).
	Origin string
	State  State
	Since  time.Time
	// LastError is why the last session or attempt ended.
	LastError string
	// Established counts the sessions the node acknowledged.
	Established int64
}

// RouteStatus is one configured route and the node's acknowledgement.
type RouteStatus struct {
	Name        string `json:"name"`
	Kind        string `json:"kind"`
	Target      string `json:"target"`
	Host        string `json:"host,omitempty"`
	HostPattern string `json:"host_pattern,omitempty"`
	ListenPort  int    `json:"listen_port,omitempty"`
	// Ack is pending, accepted or rejected; Reason the node's for a
	// rejection.
	Ack    string `json:"ack"`
	Reason string `json:"reason,omitempty"`
	// Bytes relayed by the route's ended connections, each way.
	BytesFromClient int64 `json:"bytes_from_client"`
	BytesToClient   int64 `json:"bytes_to_client"`
}

// OverlapStatus is one route of a session that an agent of another
// credential serves too. Shadowed: that agent comes first in the node's
// routing order, so with lb_policy first this agent's route serves
// nothing.
type OverlapStatus struct {
	Route           string `json:"route"`
	OtherCredential string `json:"other_credential"`
	OtherAgentID    string `json:"other_agent_id"`
	Shadowed        bool   `json:"shadowed"`
}

// PortClaim is a listen port a route asks the node to bind.
type PortClaim struct {
	Port   int    `json:"port"`
	Route  string `json:"route"`
	Ack    string `json:"ack"`
	Reason string `json:"reason,omitempty"`
}

// LimitsStatus are the limits in use, as configured or derived.
type LimitsStatus struct {
	MaxConnections    int64 `json:"max_connections"`
	ConnectionsActive int   `json:"connections_active"`
	TunnelBudget      int64 `json:"tunnel_budget"`
	MemoryLimit       int64 `json:"memory_limit"`
}

// routeAck is the node's word on one route.
type routeAck struct {
	state, reason string
}

// liveState is what the status reports of a link beyond its counters,
// recorded as it changes (a state change, an AdvertiseAck, a session's
// end): rare events, under one lock.
type liveState struct {
	mu        sync.Mutex
	since     time.Time
	state     State
	nodeID    string // the node last reached
	nodeBuild string
	transport string
	direct    bool
	lastError string
	acks      map[string]routeAck // by route name; absent: pending
	// credential and overlaps are the latest AdvertiseAck's, for the
	// connected session.
	credential string
	overlaps   []OverlapStatus
}

// setState records a change of the connection cycle's state.
func (l *liveState) setState(s State) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.state != s || l.since.IsZero() {
		l.state, l.since = s, time.Now()
	}
}

// connected records a session the node acknowledged.
func (l *liveState) connected(nodeID, nodeBuild, transport string, direct bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nodeID, l.nodeBuild, l.transport, l.direct = nodeID, nodeBuild, transport, direct
}

// disconnected forgets the session: the node no longer has the routes.
func (l *liveState) disconnected() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nodeBuild, l.transport, l.direct = "", "", false
	l.acks, l.credential, l.overlaps = nil, "", nil
}

// ack records the node's word on the routes, which every AdvertiseAck
// states whole, with their overlaps and the session's credential.
func (l *liveState) ack(ack *tunnelpb.AdvertiseAck) {
	acks := make(map[string]routeAck, len(ack.GetAccepted())+len(ack.GetRejected()))
	for _, k := range ack.GetAccepted() {
		acks[k.GetName()] = routeAck{state: AckAccepted}
	}
	for _, r := range ack.GetRejected() {
		acks[r.GetName()] = routeAck{state: AckRejected, reason: r.GetReason()}
	}
	overlaps := make([]OverlapStatus, 0, len(ack.GetOverlaps()))
	for _, o := range ack.GetOverlaps() {
		overlaps = append(overlaps, OverlapStatus{Route: o.GetName(), OtherCredential: credentialName(o.GetOtherCredential()),
			OtherAgentID: o.GetOtherAgentId(), Shadowed: o.GetShadowed()})
	}
	l.mu.Lock()
	l.acks, l.credential, l.overlaps = acks, credentialName(ack.GetCredential()), overlaps
	l.mu.Unlock()
}

func (l *liveState) setLastError(msg string) {
	l.mu.Lock()
	l.lastError = msg
	l.mu.Unlock()
}

// setNodeID records the node reached by a session that did not serve.
func (l *liveState) setNodeID(id string) {
	l.mu.Lock()
	l.nodeID = id
	l.mu.Unlock()
}

// node returns the id of the node last reached.
func (l *liveState) node() string {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.nodeID
}

// routeAck returns the node's word on route name.
func (l *liveState) routeAck(name string) routeAck {
	if ra, ok := l.acks[name]; ok {
		return ra
	}
	return routeAck{state: AckPending}
}

// recordAck takes an AdvertiseAck into the link's status and the
// agent's counters.
func (l *link) recordAck(ack *tunnelpb.AdvertiseAck) {
	l.live.ack(ack)
	for _, r := range ack.GetRejected() {
		l.a.counters.route(r.GetName()).advRejected.Add(1)
	}
}

// Ready reports whether the agent serves through at least one node: a
// link is connected (its node is not draining it) and the agent is not
// leaving. Else reason says why: what /readyz answers, followed there by
// each link's state (readyDetail). A node that is draining, or an agent
// that is leaving, routes nothing new.
func (a *Agent) Ready() (ready bool, reason string) {
	if a.leavingNow() {
		return false, "the agent is shutting down"
	}
	links := a.cluster.links()
	draining := 0
	for _, l := range links {
		switch l.state() {
		case StateConnected:
			return true, ""
		case StateDraining:
			draining++
		}
	}
	switch {
	case len(links) == 0:
		return false, a.cluster.noLinkReason()
	case len(links) == 1:
		return false, links[0].notReady()
	case draining == len(links):
		return false, fmt.Sprintf("every one of the %d nodes is draining its session", len(links))
	}
	return false, fmt.Sprintf("no session with any of the %d nodes", len(links))
}

// notReady says why the agent's only link serves nothing.
func (l *link) notReady() string {
	url := l.target.Load().url
	l.live.mu.Lock()
	st, lastErr := l.live.state, l.live.lastError
	l.live.mu.Unlock()
	if st == StateDraining {
		return fmt.Sprintf("the node %s is draining the session", url)
	}
	reason := fmt.Sprintf("no session with %s (%s)", url, st)
	if lastErr != "" {
		reason += ": " + lastErr
	}
	return reason
}

// readyDetail is the body of /readyz after its first line: a line per
// link with the node's id ("-" before any), URL, state, since when, and
// the last error.
func (a *Agent) readyDetail() string {
	var b strings.Builder
	for _, ls := range a.Links() {
		fmt.Fprintf(&b, "node %s %s %s since %s", cmp.Or(ls.NodeID, "-"), ls.URL, ls.State, ls.Since.UTC().Format(time.RFC3339))
		if ls.LastError != "" {
			fmt.Fprintf(&b, " last_error=%q", ls.LastError)
		}
		b.WriteByte('\n')
	}
	return b.String()
}

// Links returns the agent's links, one per node, in the order they were
// opened (the server's first): each node's id, URL, state and last error.
// A link leaving its node is listed until its session ended.
func (a *Agent) Links() []LinkStatus {
	links := a.cluster.links()
	out := make([]LinkStatus, 0, len(links))
	for _, l := range links {
		out = append(out, l.status())
	}
	return out
}

// status is the link's LinkStatus.
func (l *link) status() LinkStatus {
	t := l.target.Load()
	ls := LinkStatus{URL: t.url, Origin: l.origin.String(), Established: l.established.Load()}
	l.live.mu.Lock()
	ls.NodeID, ls.State, ls.Since, ls.LastError = l.live.nodeID, l.live.state, l.live.since, l.live.lastError
	l.live.mu.Unlock()
	ls.NodeID = cmp.Or(ls.NodeID, t.member)
	return ls
}

// Status returns the agent's status, as /status reports it.
func (a *Agent) Status() Status {
	ready, reason := a.Ready()
	links := a.cluster.links()
	s := Status{
		AgentID:  a.cfg.ID,
		Build:    BuildString(),
		Ready:    ready,
		Reason:   reason,
		Sessions: make([]SessionStatus, 0, len(links)),
		Limits: LimitsStatus{
			MaxConnections:    a.conn.maxConns,
			ConnectionsActive: a.ActiveConns(),
			TunnelBudget:      a.limits.Budget,
			MemoryLimit:       a.limits.Memory,
		},
	}
	for _, l := range links {
		s.Sessions = append(s.Sessions, l.sessionStatus())
	}
	s.Routes, s.PortClaims = a.routeStatus(links)
	return s
}

// sessionStatus is the status of the link's session.
func (l *link) sessionStatus() SessionStatus {
	ls := l.status()
	ss := SessionStatus{
		Server:      l.configured(),
		URL:         ls.URL,
		Origin:      ls.Origin,
		NodeID:      ls.NodeID,
		Connections: l.stats().Conns,
		Established: ls.Established,
		Reconnects:  l.reconnects.Load(),
	}
	l.live.mu.Lock()
	defer l.live.mu.Unlock()
	ss.State, ss.Since = l.live.state.String(), l.live.since
	ss.NodeBuild, ss.Transport, ss.DirectSockets = l.live.nodeBuild, l.live.transport, l.live.direct
	ss.Draining, ss.LastError = l.live.state == StateDraining, l.live.lastError
	ss.Credential = l.live.credential
	ss.Overlaps = append([]OverlapStatus{}, l.live.overlaps...) // [] rather than null
	return ss
}

// configured is the link's address as configured: the server setting
// for the server's link and its addresses, the member's URL for a member.
func (l *link) configured() string {
	if l.origin == originMember {
		return l.target.Load().url
	}
	return l.a.cfg.Server
}

// routeStatus lists the configured routes, in configuration order, and the
// listen ports they claim, with the nodes' word on each (routeAckOf).
func (a *Agent) routeStatus(links []*link) ([]RouteStatus, []PortClaim) {
	routes := make([]RouteStatus, 0, len(a.cfg.Upstreams))
	claims := []PortClaim{}
	for _, u := range a.cfg.Upstreams {
		ra := routeAckOf(links, u.Name)
		rc := a.counters.route(u.Name)
		routes = append(routes, RouteStatus{
			Name: u.Name, Kind: u.Kind().String(), Target: u.Target,
			Host: u.Host, HostPattern: u.HostPattern, ListenPort: u.ListenPort,
			Ack: ra.state, Reason: ra.reason,
			BytesFromClient: rc.fromClient.Load(), BytesToClient: rc.toClient.Load(),
		})
		if u.ListenPort != 0 {
			claims = append(claims, PortClaim{Port: u.ListenPort, Route: u.Name, Ack: ra.state, Reason: ra.reason})
		}
	}
	return routes, claims
}

// routeAckOf is the nodes' word on route name: rejected when a node
// rejects it (with the first such node's reason, prefixed with its id when
// the agent has several links), else accepted when a node accepts it, else
// pending.
func routeAckOf(links []*link, name string) routeAck {
	best := routeAck{state: AckPending}
	for _, l := range links {
		l.live.mu.Lock()
		ra, node := l.live.routeAck(name), l.live.nodeID
		l.live.mu.Unlock()
		switch {
		case ra.state == AckRejected:
			if len(links) > 1 {
				ra.reason = node + ": " + ra.reason
			}
			return ra
		case ra.state == AckAccepted:
			best = ra
		}
	}
	return best
}

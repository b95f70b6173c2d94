package agent

import (
	"fmt"
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

// Status is what the agent's /status reports: its session with the node,
// its routes with the node's word on them, the listen ports they claim and
// the limits in use.
type Status struct {
	AgentID string `json:"agent_id"`
	Build   string `json:"build"`
	// Ready and Reason are /readyz's answer.
	Ready  bool   `json:"ready"`
	Reason string `json:"reason,omitempty"`
	// Sessions has one entry per node the agent should be connected to.
	Sessions   []SessionStatus `json:"sessions"`
	Routes     []RouteStatus   `json:"routes"`
	PortClaims []PortClaim     `json:"port_claims"`
	Limits     LimitsStatus    `json:"limits"`
}

// SessionStatus is the agent's session with one node.
type SessionStatus struct {
	// Server is the node's address as configured (grpc://host:port).
	Server string `json:"server"`
	// State is idle, connecting, connected, retrying or stopped; Since is
	// when it last changed.
	State string    `json:"state"`
	Since time.Time `json:"since"`
	// NodeID and NodeBuild are the node's AdvertiseAck's, while connected
	// (NodeBuild is empty from nodes older than AdvertiseAck.build).
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
	// agent started; Reconnects the attempts after one ended or failed.
	Established int64 `json:"established"`
	Reconnects  int64 `json:"reconnects"`
	// LastError is why the last session or attempt ended.
	LastError string `json:"last_error,omitempty"`
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

// liveState is what the agent's status reports beyond its counters,
// recorded as it changes (a state change, an AdvertiseAck, a session's
// end): rare events, under one lock.
type liveState struct {
	mu        sync.Mutex
	since     time.Time
	state     State
	nodeBuild string
	transport string
	direct    bool
	draining  bool
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
func (l *liveState) connected(nodeBuild, transport string, direct bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nodeBuild, l.transport, l.direct, l.draining = nodeBuild, transport, direct, false
}

// disconnected forgets the session: the node no longer has the routes.
func (l *liveState) disconnected() {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.nodeBuild, l.transport, l.direct, l.draining = "", "", false, false
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

func (l *liveState) setDraining() {
	l.mu.Lock()
	l.draining = true
	l.mu.Unlock()
}

func (l *liveState) setLastError(msg string) {
	l.mu.Lock()
	l.lastError = msg
	l.mu.Unlock()
}

// routeAck returns the node's word on route name.
func (l *liveState) routeAck(name string) routeAck {
	if ra, ok := l.acks[name]; ok {
		return ra
	}
	return routeAck{state: AckPending}
}

// recordAck takes an AdvertiseAck into the status and the counters.
func (a *Agent) recordAck(ack *tunnelpb.AdvertiseAck) {
	a.live.ack(ack)
	for _, r := range ack.GetRejected() {
		a.counters.route(r.GetName()).advRejected.Add(1)
	}
}

// Ready reports whether the agent has a session established with every
// node it should be connected to (it keeps one, with Config.Server), and
// why not: what /readyz answers. A session whose node is draining, or an
// agent that is leaving, is not ready: the node routes it nothing new.
func (a *Agent) Ready() (ready bool, reason string) {
	a.live.mu.Lock()
	draining, lastErr := a.live.draining, a.live.lastError
	a.live.mu.Unlock()
	st := a.State()
	switch {
	case a.leavingNow():
		return false, "the agent is shutting down"
	case st != StateConnected:
		reason = fmt.Sprintf("no session with %s (%s)", a.cfg.Server, st)
		if lastErr != "" {
			reason += ": " + lastErr
		}
		return false, reason
	case draining:
		return false, fmt.Sprintf("the node %s is draining the session", a.cfg.Server)
	}
	return true, ""
}

// Status returns the agent's status, as /status reports it.
func (a *Agent) Status() Status {
	ready, reason := a.Ready()
	s := Status{
		AgentID:  a.cfg.ID,
		Build:    BuildString(),
		Ready:    ready,
		Reason:   reason,
		Sessions: []SessionStatus{a.sessionStatus()},
		Limits: LimitsStatus{
			MaxConnections:    a.conn.maxConns,
			ConnectionsActive: a.ActiveConns(),
			TunnelBudget:      a.limits.Budget,
			MemoryLimit:       a.limits.Memory,
		},
	}
	s.Routes, s.PortClaims = a.routeStatus()
	return s
}

// sessionStatus is the status of the session with Config.Server.
func (a *Agent) sessionStatus() SessionStatus {
	ss := SessionStatus{
		Server:      a.cfg.Server,
		NodeID:      a.NodeID(),
		Connections: a.Stats().Conns,
		Established: a.Sessions(),
		Reconnects:  a.counters.reconnects.Load(),
	}
	a.live.mu.Lock()
	defer a.live.mu.Unlock()
	ss.State, ss.Since = a.live.state.String(), a.live.since
	ss.NodeBuild, ss.Transport, ss.DirectSockets = a.live.nodeBuild, a.live.transport, a.live.direct
	ss.Draining, ss.LastError = a.live.draining, a.live.lastError
	ss.Credential = a.live.credential
	ss.Overlaps = append([]OverlapStatus{}, a.live.overlaps...) // [] rather than null
	return ss
}

// routeStatus lists the configured routes, in configuration order, and the
// listen ports they claim, with the node's word on each.
func (a *Agent) routeStatus() ([]RouteStatus, []PortClaim) {
	routes := make([]RouteStatus, 0, len(a.cfg.Upstreams))
	claims := []PortClaim{}
	a.live.mu.Lock()
	defer a.live.mu.Unlock()
	for _, u := range a.cfg.Upstreams {
		ra := a.live.routeAck(u.Name)
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

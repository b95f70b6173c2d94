package caddymodule

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"sync"
	"sync/atomic"
	"time"
	"unicode/utf8"

	"github.com/prometheus/client_golang/prometheus"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Node metrics go into the registry of each Caddy config
// (caddy.Context.GetMetricsRegistry), so they appear wherever the user's
// Caddy exposes metrics: the admin endpoint's /metrics and the `metrics`
// handler. Caddy makes a new registry for every config, and the nodes
// outlive configs (nodePool), so the collector is one package-level value
// that every config registers again; it reads the nodes of the process
// when it is scraped.
//
// State (sessions, connections open, budget, limits, port claims) is read
// at scrape time, which costs the data path nothing. Counters live in each
// node (nodeCounters) and are bumped at the few seams where things end or
// are refused: node.connEnded, node.logLimit, the handshake's refusals,
// admission. Nothing is counted per byte or per frame.

// maxRouteLabels bounds the distinct route label values one node reports.
// Route names come from agents; past the bound a route's series go under
// otherRoute. A route that is gone keeps its series (counters must not
// go back), so the bound is over the node's life.
const maxRouteLabels = 10000

// otherRoute is the route label of the routes past maxRouteLabels.
const otherRoute = "(other)"

// defaultNodeID is the node label when node_id is not set: the host name.
func defaultNodeID() string {
	if h, err := os.Hostname(); err == nil && h != "" {
		return h
	}
	return "sluice"
}

// registerMetrics registers the package's collector into reg. A registry
// that has it already (a second app provisioned into one config) is fine.
func registerMetrics(reg *prometheus.Registry) error {
	if reg == nil {
		return nil
	}
	err := reg.Register(sluiceMetrics)
	if are := (prometheus.AlreadyRegisteredError{}); errors.As(err, &are) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("sluice: registering metrics: %w", err)
	}
	return nil
}

// sluiceMetrics is the collector every config registers: it reports every
// node of the process.
var sluiceMetrics = newMetricsCollector(metricsNodes)

// metricsNodes lists the nodes of the process.
func metricsNodes() []*node {
	var out []*node
	nodePool.Range(func(_, v any) bool {
		out = append(out, v.(*node))
		return true
	})
	return out
}

// Labels of the bounded sets the counters use.
var (
	connKindNames = [...]string{"http", "http_upgraded", "tcp", "udp"}

	// streamRefusalNames: why an authenticated agent stream was refused.
	streamRefusalNames = [...]string{
		"max_pending_streams", "max_pending_streams_per_address", "max_sessions", "max_sessions_per_address",
		"draining", "advertise_timeout", "invalid_advertise", "credential_changed", "max_sessions_per_credential",
		"stream_ended",
	}
	// limitReasonNames: which limit refused a client's connection or request.
	limitReasonNames = [...]string{"max_connections", "agent_max_connections", "max_connections_per_address", "allowed_cidrs", "other"}
	// routeRejectNames: why admission rejected an advertised route.
	routeRejectNames = [...]string{"invalid", "pattern_budget", "port", "out_of_scope"}
)

const numOutcomes = int(tunnelcore.ConnFailed) + 1

// streamRefusal indexes streamRefusalNames.
type streamRefusal int

const (
	refusedPending streamRefusal = iota
	refusedPendingPerAddr
	refusedSessions
	refusedSessionsPerAddr
	refusedDraining
	refusedAdvertiseTimeout
	refusedInvalidAdvertise
	refusedCredentialChanged
	refusedSessionsPerCredential
	refusedStreamEnded
)

// routeReject indexes routeRejectNames.
type routeReject int

const (
	rejectInvalid routeReject = iota
	rejectPatternBudget
	rejectPort
	rejectOutOfScope
)

// limitReason maps a limit name logLimit gets to its label index; the
// names are the code's own, so the set is bounded, and "other" catches
// any added later without a label here.
func limitReason(limit string) int {
	switch limit {
	case "max_connections":
		return 0
	case agentConnLimit.String():
		return 1
	case "max_connections_per_address":
		return 2
	case "allowed_cidrs":
		return 3
	}
	return len(limitReasonNames) - 1
}

// routeCounters are one route's counters: bytes each way and the
// connections that ended, by kind and outcome.
type routeCounters struct {
	label    string // the route name
	toAgent  atomic.Int64
	toClient atomic.Int64
	ends     [len(connKindNames)][numOutcomes]atomic.Int64
}

// nodeCounters are a node's counters.
type nodeCounters struct {
	routes     sync.Map // route name → *routeCounters
	routeCount atomic.Int64
	other      routeCounters // the routes past maxRouteLabels

	stalls            atomic.Int64
	advertiseTimeouts atomic.Int64
	streamsRefused    [len(streamRefusalNames)]atomic.Int64
	limitRefused      [len(limitReasonNames)]atomic.Int64
	routesRejected    [len(routeRejectNames)]atomic.Int64
	// tunnel counts the flow-control events of every session of the node
	// (tunnelcore.Config.Counters).
	tunnel tunnelcore.Counters
	// streams counts the exchanges the stream policy classified as
	// streams, by class and outcome (Handler.logStream).
	streams [len(streamClassNames)][len(streamOutcomeNames)]atomic.Int64
}

// streamClassNames and streamOutcomeNames are the label values of
// sluice_streams_total: the stream policy's classifications (streaming.go)
// and how exchanges end (outcome).
var (
	streamClassNames   = [...]string{classPathPrefix, classAccept, classContentType, classUpgrade, "none"}
	streamOutcomeNames = [...]string{outcomeCompleted, outcomeClientDisconnect, outcomeUpstreamError, outcomeExchangeTimeout, outcomeIdleTimeout, outcomeShutdown}
)

// countStream counts an exchange of class that ended with outcome; values
// outside the bounded sets are not counted.
func (c *nodeCounters) countStream(class, outcome string) {
	if class == "" {
		class = "none"
	}
	ci, oi := slices.Index(streamClassNames[:], class), slices.Index(streamOutcomeNames[:], outcome)
	if ci >= 0 && oi >= 0 {
		c.streams[ci][oi].Add(1)
	}
}

// route returns the counters of the route named name: one map lookup once
// the route was seen. Names longer than an advertised route name may be
// are no route's: they join otherRoute.
func (c *nodeCounters) route(name string) *routeCounters {
	if v, ok := c.routes.Load(name); ok {
		return v.(*routeCounters)
	}
	// A name that is no valid label value (not UTF-8) joins otherRoute
	// too: mending it could make it another route's label.
	if name == otherRoute || len(name) > tunnelpb.MaxRouteNameLength || !utf8.ValidString(name) {
		return &c.other
	}
	if c.routeCount.Add(1) > maxRouteLabels {
		c.routeCount.Add(-1)
		return &c.other
	}
	v, loaded := c.routes.LoadOrStore(name, &routeCounters{label: name})
	if loaded {
		c.routeCount.Add(-1)
	}
	return v.(*routeCounters)
}

// connEnded counts a virtual connection the node opened that ended: a
// map lookup and three atomic adds. Connections agents open are refused
// at once (tunnelcore.Config.RefuseOpens) and carry no route: they are not counted.
func (c *nodeCounters) connEnded(e tunnelcore.ConnEnd) {
	if !e.OpenedHere {
		return
	}
	r := c.route(e.Info.RouteKey)
	r.toAgent.Add(e.Written)
	r.toClient.Add(e.Read)
	kind := connKindOf(e.Info)
	out := int(e.Outcome)
	if out < 0 || out >= numOutcomes {
		out = int(tunnelcore.ConnFailed)
	}
	r.ends[kind][out].Add(1)
}

// connTotals sums the routes' counters: the connections the node opened
// that ended, those of them not closed cleanly, and their bytes each way.
type connTotals struct{ ended, failed, toClients, fromClients int64 }

// totals adds up every route's counters (a read of up to maxRouteLabels
// routes, for status snapshots, never on the data path).
func (c *nodeCounters) totals() connTotals {
	var t connTotals
	add := func(r *routeCounters) {
		t.toClients += r.toClient.Load()
		t.fromClients += r.toAgent.Load()
		for k := range r.ends {
			for o := range r.ends[k] {
				v := r.ends[k][o].Load()
				t.ended += v
				if tunnelcore.ConnOutcome(o) != tunnelcore.ConnClosed {
					t.failed += v
				}
			}
		}
	}
	c.routes.Range(func(_, v any) bool { add(v.(*routeCounters)); return true })
	add(&c.other)
	return t
}

// labelOf is the route label of r.
func (c *nodeCounters) labelOf(r *routeCounters) string {
	if r == &c.other {
		return otherRoute
	}
	return r.label
}

// refuseLimit counts a client connection or request a limit refused.
func (c *nodeCounters) refuseLimit(limit string) { c.limitRefused[limitReason(limit)].Add(1) }

func (c *nodeCounters) refuseStream(r streamRefusal) { c.streamsRefused[r].Add(1) }

func (c *nodeCounters) rejectRoutes(r routeReject, n int) {
	if n > 0 {
		c.routesRejected[r].Add(int64(n))
	}
}

// metricsID is the node label: node_id of the config that runs the node.
func (n *node) metricsID() string {
	if id := n.opts.Load().nodeID; id != "" {
		return id
	}
	return defaultNodeID()
}

// labelledNode is a node with the node label it reports under.
type labelledNode struct {
	n  *node
	id string
}

// labelNodes gives each node its label. Nodes of one process sharing a
// node id (several control addresses, or the moment a reload moves the
// control address) would report the same series, which fails the whole
// scrape: those report "<node_id>@<listen>".
func labelNodes(nodes []*node) []labelledNode {
	out := make([]labelledNode, len(nodes))
	count := map[string]int{}
	for i, n := range nodes {
		out[i] = labelledNode{n, n.metricsID()}
		count[out[i].id]++
	}
	for i := range out {
		if count[out[i].id] > 1 {
			out[i].id += "@" + out[i].n.addr
		}
	}
	return out
}

// metricsCollector is the prometheus.Collector of the nodes' metrics.
type metricsCollector struct {
	nodes func() []*node

	sessions, sessionsLane, sessionsBuildUnknown, directSockets *prometheus.Desc
	bytes, connsActive, connsTotal                              *prometheus.Desc
	budget, budgetUsed, buffered                                *prometheus.Desc
	stallFailures, advertiseTimeouts, streamsRefused            *prometheus.Desc
	streamsPending, streamsPendingLimit, controlPending         *prometheus.Desc
	sessionsLimit, awaitingAgent                                *prometheus.Desc
	dataLimit, dataAdmitted, dataRejected                       *prometheus.Desc
	authFailures, advertiseRejected, portClaims                 *prometheus.Desc
	windowUpdates, creditWaits, stallSeconds, streamsTotal      *prometheus.Desc
	udp                                                         udpMetrics // udp_metrics.go
}

// newMetricsCollector describes every metric; nodes lists what to report.
// The metric table of the README documents each one.
func newMetricsCollector(nodes func() []*node) *metricsCollector {
	d := func(name, help string, labels ...string) *prometheus.Desc {
		return prometheus.NewDesc(name, help, append([]string{"node"}, labels...), nil)
	}
	return &metricsCollector{
		udp:                  newUDPMetrics(d),
		nodes:                nodes,
		sessions:             d("sluice_tunnel_sessions", "Agent sessions registered, leaving ones included."),
		sessionsLane:         d("sluice_tunnel_sessions_lane", "Agent sessions running on a data lane."),
		sessionsBuildUnknown: d("sluice_tunnel_sessions_build_unknown", "Agent sessions whose agent sent no build."),
		directSockets:        d("sluice_direct_sockets", "Virtual connections running on a direct socket."),
		bytes:                d("sluice_tunnel_bytes_total", "Payload bytes of ended virtual connections, by route and direction (to_agent, to_client).", "route", "direction"),
		connsActive:          d("sluice_connections_active", "Virtual connections open, by route.", "route"),
		connsTotal:           d("sluice_connections_total", "Virtual connections that ended, by route, kind and outcome.", "route", "kind", "outcome"),
		budget:               d("sluice_tunnel_budget_bytes", "The tunnel budget: what receive windows above 64 KiB may hold."),
		budgetUsed:           d("sluice_tunnel_budget_used_bytes", "Tunnel budget in use."),
		buffered:             d("sluice_tunnel_buffered_bytes", "Bytes received from agents not yet written to clients."),
		stallFailures:        d("sluice_tunnel_stall_failures_total", "Agent sessions ended by the stall watchdog."),
		advertiseTimeouts:    d("sluice_tunnel_advertise_timeouts_total", "Agent streams that sent no Advertise within advertise_timeout."),
		streamsRefused:       d("sluice_tunnel_streams_refused_total", "Authenticated agent streams refused, by reason.", "reason"),
		streamsPending:       d("sluice_tunnel_streams_pending", "Authenticated agent streams that have not advertised yet."),
		streamsPendingLimit:  d("sluice_tunnel_streams_pending_limit", "max_pending_streams."),
		controlPending:       d("sluice_control_connections_pending", "Control connections that have not authenticated yet."),
		sessionsLimit:        d("sluice_tunnel_sessions_limit", "max_sessions."),
		awaitingAgent:        d("sluice_requests_awaiting_agent", "Requests waiting (lb_try_duration) for an agent to serve their host."),
		dataLimit:            d("sluice_data_connections_limit", "max_connections: virtual connections that may be open at once."),
		dataAdmitted:         d("sluice_data_connections_admitted", "Connection slots taken (open virtual connections and idle pooled ones)."),
		dataRejected:         d("sluice_data_connections_rejected_total", "Client connections and requests refused by a limit, by reason.", "reason"),
		authFailures:         d("sluice_auth_failures_total", "Agent streams refused for a wrong or missing token."),
		advertiseRejected:    d("sluice_advertise_rejected_total", "Advertised routes rejected at admission, by reason.", "reason"),
		portClaims:           d("sluice_port_claims", "Claimed ports: bound (one owner each) and standby claims.", "state"),
		windowUpdates:        d("sluice_tunnel_window_updates_total", "Credit grants (WindowUpdate frames with an increment), by direction (sent, received).", "direction"),
		creditWaits:          d("sluice_tunnel_credit_waits_total", "Times a connection had bytes for its agent and waited for its credit."),
		stallSeconds:         d("sluice_tunnel_stall_seconds", "How long the most stalled session's stream has had a send blocked; 0 when none."),
		streamsTotal:         d("sluice_streams_total", "Exchanges the stream policy classified as streams, by class and outcome.", "class", "outcome"),
	}
}

// Describe implements prometheus.Collector.
func (m *metricsCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{
		m.sessions, m.sessionsLane, m.sessionsBuildUnknown, m.directSockets,
		m.bytes, m.connsActive, m.connsTotal, m.budget, m.budgetUsed, m.buffered,
		m.stallFailures, m.advertiseTimeouts, m.streamsRefused,
		m.streamsPending, m.streamsPendingLimit, m.controlPending, m.sessionsLimit, m.awaitingAgent,
		m.dataLimit, m.dataAdmitted, m.dataRejected, m.authFailures, m.advertiseRejected, m.portClaims,
		m.windowUpdates, m.creditWaits, m.stallSeconds, m.streamsTotal,
	} {
		ch <- d
	}
	m.udp.describe(ch)
}

// Collect implements prometheus.Collector: it reads each node's state now.
func (m *metricsCollector) Collect(ch chan<- prometheus.Metric) {
	for _, ln := range labelNodes(m.nodes()) {
		e := emitter{ch: ch, node: ln.id}
		m.collectSessions(e, ln.n)
		m.collectLimits(e, ln.n)
		m.collectCounters(e, ln.n)
		m.udp.collect(e, ln.n)
	}
}

// emitter sends const metrics of one node.
type emitter struct {
	ch   chan<- prometheus.Metric
	node string
}

func (e emitter) gauge(d *prometheus.Desc, v float64, labels ...string) {
	e.ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, append([]string{e.node}, labels...)...)
}

func (e emitter) counter(d *prometheus.Desc, v float64, labels ...string) {
	e.ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v, append([]string{e.node}, labels...)...)
}

// sessionTally is what collectSessions reads off the sessions.
type sessionTally struct {
	sessions, lane, buildUnknown, direct int
	buffered                             int64
	stalled                              time.Duration  // the longest blocked send
	active                               map[string]int // open connections by route name
}

// tallySessions walks every session and its open connections once.
func tallySessions(n *node) sessionTally {
	t := sessionTally{active: map[string]int{}}
	now := time.Now()
	for _, a := range n.reg.sessions() {
		t.sessions++
		if a.lane {
			t.lane++
		}
		if a.build == "" {
			t.buildUnknown++
		}
		t.stalled = max(t.stalled, a.sess.SendBlockedFor(now))
		t.buffered += a.sess.Stats().Buffered
		for _, c := range a.sess.Conns() {
			if !c.OpenedHere() {
				continue // an agent's, refused at once: its key is the agent's word, not a route
			}
			t.active[c.Info().RouteKey]++
			if c.Direct() {
				t.direct++
			}
		}
	}
	return t
}

// collectSessions reports the sessions and their open connections.
func (m *metricsCollector) collectSessions(e emitter, n *node) {
	t := tallySessions(n)
	e.gauge(m.sessions, float64(t.sessions))
	e.gauge(m.sessionsLane, float64(t.lane))
	e.gauge(m.stallSeconds, t.stalled.Seconds())
	e.gauge(m.sessionsBuildUnknown, float64(t.buildUnknown))
	e.gauge(m.directSockets, float64(t.direct))
	e.gauge(m.buffered, float64(t.buffered))
	// By label, as routes past maxRouteLabels share one. The names are
	// those of admitted routes: tallySessions counts only the
	// connections the node opened, whose keys it set itself.
	byLabel := make(map[string]int, len(t.active))
	for name, open := range t.active {
		byLabel[n.metrics.labelOf(n.metrics.route(name))] += open
	}
	for label, open := range byLabel {
		e.gauge(m.connsActive, float64(open), label)
	}
}

// collectLimits reports the node's limits and what is taken of them.
func (m *metricsCollector) collectLimits(e emitter, n *node) {
	opts := n.opts.Load()
	e.gauge(m.budget, float64(n.budget.Limit()))
	e.gauge(m.budgetUsed, float64(n.budget.InUse()))
	e.gauge(m.streamsPending, float64(n.pending.count()))
	e.gauge(m.streamsPendingLimit, float64(opts.maxPending))
	e.gauge(m.controlPending, float64(n.guard.pendingCount()))
	e.gauge(m.sessionsLimit, float64(opts.maxSessions))
	e.gauge(m.awaitingAgent, float64(n.awaitingAgent.Load()))
	e.gauge(m.dataLimit, float64(n.slots.Limit()))
	e.gauge(m.dataAdmitted, float64(n.slots.InUse()))
	bound, standby := n.ports.claimCounts()
	e.gauge(m.portClaims, float64(bound), "bound")
	e.gauge(m.portClaims, float64(standby), "standby")
}

// collectCounters reports the node's counters.
func (m *metricsCollector) collectCounters(e emitter, n *node) {
	c := &n.metrics
	e.counter(m.stallFailures, float64(c.stalls.Load()))
	e.counter(m.advertiseTimeouts, float64(c.advertiseTimeouts.Load()))
	e.counter(m.authFailures, float64(n.authFailures.Load()))
	for i, name := range streamRefusalNames {
		e.counter(m.streamsRefused, float64(c.streamsRefused[i].Load()), name)
	}
	for i, name := range limitReasonNames {
		e.counter(m.dataRejected, float64(c.limitRefused[i].Load()), name)
	}
	for i, name := range routeRejectNames {
		e.counter(m.advertiseRejected, float64(c.routesRejected[i].Load()), name)
	}
	e.counter(m.windowUpdates, float64(c.tunnel.WindowUpdatesSent.Load()), "sent")
	e.counter(m.windowUpdates, float64(c.tunnel.WindowUpdatesReceived.Load()), "received")
	e.counter(m.creditWaits, float64(c.tunnel.CreditWaits.Load()))
	for ci, class := range streamClassNames {
		for oi, out := range streamOutcomeNames {
			if v := c.streams[ci][oi].Load(); v != 0 {
				e.counter(m.streamsTotal, float64(v), class, out)
			}
		}
	}
	c.routes.Range(func(_, v any) bool {
		m.collectRoute(e, v.(*routeCounters).label, v.(*routeCounters))
		return true
	})
	if c.other.toAgent.Load() != 0 || c.other.toClient.Load() != 0 || c.other.anyEnded() {
		m.collectRoute(e, otherRoute, &c.other)
	}
}

// collectRoute reports one route's counters; of the connections that
// ended, the kinds and outcomes that occurred.
func (m *metricsCollector) collectRoute(e emitter, label string, r *routeCounters) {
	e.counter(m.bytes, float64(r.toAgent.Load()), label, "to_agent")
	e.counter(m.bytes, float64(r.toClient.Load()), label, "to_client")
	for k := range r.ends {
		for o := range r.ends[k] {
			if v := r.ends[k][o].Load(); v != 0 {
				e.counter(m.connsTotal, float64(v), label, connKindNames[k], tunnelcore.ConnOutcome(o).String())
			}
		}
	}
}

// anyEnded reports whether any connection of r ended.
func (r *routeCounters) anyEnded() bool {
	for k := range r.ends {
		for o := range r.ends[k] {
			if r.ends[k][o].Load() != 0 {
				return true
			}
		}
	}
	return false
}

package agent

import (
	"sync/atomic"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// unknownRoute is the route label of the connections the node opened for
// a route the agent does not serve: the node names it, so it is not used
// as a label value, which must stay bounded.
const unknownRoute = "(unknown)"

// numOutcomes is the number of ConnOutcome values.
const numOutcomes = int(ConnReset) + 1

// routeCounters are one route's counters, fed once per connection (at its
// end, by the WithConnEnd seam) and once per AdvertiseAck: nothing on the
// data path.
type routeCounters struct {
	fromClient, toClient atomic.Int64
	outcomes             [numOutcomes]atomic.Int64
	// advRejected counts the node's rejections of the route, one per
	// AdvertiseAck that lists it as rejected.
	advRejected atomic.Int64
}

// connCounters are the counters the agent keeps for its metrics and
// status. The route set is the configuration's, fixed at New, so the map
// is read without a lock and the label values are bounded.
type connCounters struct {
	routes  map[string]*routeCounters
	unknown routeCounters // connections for routes the agent does not serve
	// reconnects counts the session attempts made after a session or an
	// attempt ended.
	reconnects atomic.Int64
}

func newConnCounters(cfg *Config) *connCounters {
	c := &connCounters{routes: make(map[string]*routeCounters, len(cfg.Upstreams))}
	for _, u := range cfg.Upstreams {
		c.routes[u.Name] = new(routeCounters)
	}
	return c
}

// route returns the counters of a route name, the unknown bucket's for a
// name the configuration does not have.
func (c *connCounters) route(name string) *routeCounters {
	if r := c.routes[name]; r != nil {
		return r
	}
	return &c.unknown
}

// record counts one ended connection.
func (c *connCounters) record(r ConnReport) {
	rc := c.route(r.Route)
	rc.fromClient.Add(r.FromClient)
	rc.toClient.Add(r.ToClient)
	if o := int(r.Outcome); o >= 0 && o < numOutcomes {
		rc.outcomes[o].Add(1)
	}
}

// limitRejected is the connections refused at max_connections, all routes.
func (c *connCounters) limitRejected() int64 {
	n := c.unknown.outcomes[ConnLimit].Load()
	for _, r := range c.routes {
		n += r.outcomes[ConnLimit].Load()
	}
	return n
}

// Metric descriptions of the agent's collector. The names match the
// node's where they mean the same (sluice_connections_active, ...).
var (
	descSessions = prometheus.NewDesc("sluice_tunnel_sessions",
		"Tunnel sessions established with the nodes (the node acknowledged the Advertise), one at most per node.", nil, nil)
	descLinkState = prometheus.NewDesc("sluice_node_session_state",
		"The state of the agent's session with each node: 1 for the state it is in, 0 for the others. node is the node's id (empty before the server's node answered), url where the agent dials it.",
		[]string{"node", "url", "state"}, nil)
	descActive = prometheus.NewDesc("sluice_connections_active",
		"Connections the node opened that are being dialed or relayed.", nil, nil)
	descReconnects = prometheus.NewDesc("sluice_reconnect_total",
		"Session attempts made after a session or an attempt ended.", nil, nil)
	descAdvRejected = prometheus.NewDesc("sluice_advertise_rejected_total",
		"Routes the node rejected, one per AdvertiseAck that lists the route as rejected.", []string{"route"}, nil)
	descLimit = prometheus.NewDesc("sluice_connections_limit",
		"The agent's connection limit (max_connections, or derived from the memory limit).", nil, nil)
	descAdmitted = prometheus.NewDesc("sluice_connections_admitted",
		"Connections holding a place of the connection limit.", nil, nil)
	descLimitRejected = prometheus.NewDesc("sluice_connections_rejected_total",
		"Connections refused because the connection limit was reached.", nil, nil)
	descBytes = prometheus.NewDesc("sluice_tunnel_bytes_total",
		"Payload bytes relayed by ended connections, by route and direction (from_client: towards the upstream).", []string{"route", "direction"}, nil)
	descConns = prometheus.NewDesc("sluice_connections_total",
		"Connections the node opened that ended, by route and outcome.", []string{"route", "outcome"}, nil)
	descBuffered = prometheus.NewDesc("sluice_tunnel_buffered_bytes",
		"Payload the node sent that the relays have not read yet.", nil, nil)
	descQueued = prometheus.NewDesc("sluice_tunnel_queued_bytes",
		"Payload queued towards the node.", nil, nil)
	descBudget = prometheus.NewDesc("sluice_tunnel_budget_bytes",
		"The tunnel budget: bytes the receive windows above 64 KiB may hold.", nil, nil)
	descBuild = prometheus.NewDesc("sluice_build_info",
		"The agent's build, as its Advertise names it; always 1.", []string{"build"}, nil)
)

// collector is the agent's prometheus.Collector: it reads the agent's live
// state at scrape time, so the data path pays nothing for the metrics.
type collector struct{ a *Agent }

// Describe sends the descriptions of every metric the collector may send
// (some only once a link exists or an unknown route was counted).
func (c collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descSessions, descLinkState, descActive, descReconnects, descAdvRejected,
		descLimit, descAdmitted, descLimitRejected, descBytes, descConns, descBuffered, descQueued, descBudget, descBuild} {
		ch <- d
	}
	describeFlows(ch)
}

// Collect sends the agent's metrics as they are now.
func (c collector) Collect(ch chan<- prometheus.Metric) {
	a := c.a
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v int64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), labels...)
	}
	c.collectLinks(gauge)
	active := float64(a.ActiveConns())
	gauge(descActive, active)
	gauge(descAdmitted, active)
	gauge(descLimit, float64(a.conn.maxConns))
	counter(descLimitRejected, a.counters.limitRejected())
	counter(descReconnects, a.counters.reconnects.Load())
	st := a.Stats()
	gauge(descBuffered, float64(st.Buffered))
	gauge(descQueued, float64(st.Queued))
	gauge(descBudget, float64(a.limits.Budget))
	gauge(descBuild, 1, BuildString())
	c.collectRoutes(counter)
	collectFlows(&a.tunnel.Flows, gauge, counter)
}

// linkStates are the states sluice_node_session_state reports: those a
// listed link can be in.
var linkStates = []State{StateIdle, StateConnecting, StateConnected, StateRetrying, StateDraining, StateLeaving, StateStandby}

// collectLinks sends the number of sessions and each link's state. The
// links are at most the cluster's bound (maxLinks) and those leaving, so
// the node label's values are bounded; a link that shares its node and URL
// with one listed before (leaving while its successor connects) is left
// out, as a series may be sent once.
func (c collector) collectLinks(gauge func(*prometheus.Desc, float64, ...string)) {
	sessions := 0
	seen := map[[2]string]bool{}
	for _, l := range c.a.cluster.links() {
		ls := l.status()
		if sessionUp(ls.State) {
			sessions++
		}
		k := [2]string{ls.NodeID, ls.URL}
		if seen[k] {
			continue
		}
		seen[k] = true
		for _, s := range linkStates {
			v := 0.0
			if s == ls.State {
				v = 1
			}
			gauge(descLinkState, v, ls.NodeID, ls.URL, s.String())
		}
	}
	gauge(descSessions, float64(sessions))
}

// collectRoutes sends the per-route counters: every configured route's,
// and the unknown bucket's once it counted something.
func (c collector) collectRoutes(counter func(*prometheus.Desc, int64, ...string)) {
	send := func(name string, rc *routeCounters) {
		counter(descBytes, rc.fromClient.Load(), name, "from_client")
		counter(descBytes, rc.toClient.Load(), name, "to_client")
		for o := range numOutcomes {
			counter(descConns, rc.outcomes[o].Load(), name, ConnOutcome(o).String())
		}
		counter(descAdvRejected, rc.advRejected.Load(), name)
	}
	for _, u := range c.a.cfg.Upstreams {
		send(u.Name, c.a.counters.routes[u.Name])
	}
	if n := c.a.counters.unknown.outcomes[ConnUnknownRoute].Load(); n > 0 {
		counter(descConns, n, unknownRoute, ConnUnknownRoute.String())
	}
}

// MetricsCollector returns the agent's metrics as a prometheus.Collector,
// for a program that embeds the agent and serves its own registry; the
// admin listener (Config.AdminListen) serves the same ones.
func (a *Agent) MetricsCollector() prometheus.Collector { return collector{a} }

// newRegistry is the admin listener's registry: the agent's metrics and
// the Go runtime's and the process's, as a Prometheus scrape of a daemon
// expects, in a registry of its own (not the global default one a program
// embedding the agent may use).
func (a *Agent) newRegistry() *prometheus.Registry {
	reg := prometheus.NewRegistry()
	reg.MustRegister(
		collectors.NewGoCollector(),
		collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}),
		a.MetricsCollector(),
	)
	return reg
}

package caddymodule

import (
	"embed"
	"fmt"
	"io/fs"
	"net/http"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"

	"github.com/sluice-tunnel/sluice/internal/route"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func init() {
	caddy.RegisterModule(Console{})
	httpcaddyfile.RegisterHandlerDirective("sluice_console", parseConsoleDirective)
	// Like respond and sluice_health: it answers and ends the chain.
	httpcaddyfile.RegisterDirectiveOrder("sluice_console", httpcaddyfile.Before, "respond")
}

// consoleAssets is the page: plain HTML, JS and CSS compiled into the
// binary, so the console needs no CDN and works on a node with no way out.
//
//go:embed console/index.html console/app.js console/style.css
var consoleAssets embed.FS

// Console serves a read-only web console of the node of this config's
// sluice app: the node, its limits and their use, the connected agents,
// the route tables, refusals by reason and a route finder. It is a page
// and a JSON endpoint of one handler, which a site mounts under a path of
// its choosing and puts behind Caddy's own authentication (basic_auth,
// forward_auth to an OIDC proxy): the console keeps no users of its own.
//
// It shows what the admin API's /sluice/status and /sluice/lookup show,
// from the same snapshot and lookup (status.go): nothing it does moves a
// counter or a load-balancing policy, and no token or target is in it.
type Console struct {
	node *node
}

// CaddyModule returns the Caddy module information.
func (Console) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.sluice_console",
		New: func() caddy.Module { return new(Console) },
	}
}

// Provision finds the node of the config's sluice app.
func (c *Console) Provision(ctx caddy.Context) error {
	app, err := configuredSluiceApp(ctx, "sluice_console")
	if err != nil {
		return err
	}
	c.node = app.node
	return nil
}

// consoleFiles are the page's files by the last segment of their path,
// with their content types.
var consoleFiles = map[string]string{
	"index.html": "text/html; charset=utf-8",
	"app.js":     "text/javascript; charset=utf-8",
	"style.css":  "text/css; charset=utf-8",
}

// consoleCSP lets the page load its own files and call its own endpoint,
// nothing else: no inline script, no other origin, no framing.
const consoleCSP = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; " +
	"img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"

// ServeHTTP implements caddyhttp.MiddlewareHandler. It never calls next:
// it serves by the last segments of the path, so it works under any
// prefix, stripped (handle_path) or not (route, handle).
func (c *Console) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	if r.Method != http.MethodGet && r.Method != http.MethodHead {
		w.Header().Set("Allow", "GET, HEAD")
		return caddyhttp.Error(http.StatusMethodNotAllowed, fmt.Errorf("sluice_console: method %s not allowed", r.Method))
	}
	h := w.Header()
	h.Set("Content-Security-Policy", consoleCSP)
	h.Set("X-Content-Type-Options", "nosniff")
	h.Set("Referrer-Policy", "no-referrer")
	h.Set("X-Frame-Options", "DENY")
	p := r.URL.Path
	switch {
	case strings.HasSuffix(p, "/api/state"):
		return writeJSON(w, http.StatusOK, c.state(time.Now()))
	case strings.HasSuffix(p, "/api/lookup"):
		return c.serveLookup(w, r)
	}
	last := p[strings.LastIndexByte(p, '/')+1:]
	if last == "" {
		if !strings.HasSuffix(originalPath(r), "/") {
			return redirectToSlash(w, r)
		}
		last = "index.html"
	}
	if _, ok := consoleFiles[last]; !ok {
		return caddyhttp.Error(http.StatusNotFound, fmt.Errorf("sluice_console: no page %q", last))
	}
	return serveConsoleFile(w, last)
}

// originalPath is the path the client asked for, before handle_path or
// uri strip_prefix took the mount path off.
func originalPath(r *http.Request) string {
	if orig, ok := r.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok && orig.URL != nil {
		return orig.URL.Path
	}
	return r.URL.Path
}

// redirectToSlash sends a request for the mount path without its slash
// (/console, which `handle_path /console*` strips to /) to the mount path
// with it (/console/), so the page's
// relative URLs resolve under the mount. The Location is relative too:
// the handler does not know the prefix, the client does.
func redirectToSlash(w http.ResponseWriter, r *http.Request) error {
	orig := originalPath(r)
	loc := orig[strings.LastIndexByte(orig, '/')+1:] + "/"
	if loc == "/" || strings.HasPrefix(loc, "/") {
		loc = "./"
	}
	if q := r.URL.RawQuery; q != "" {
		loc += "?" + q
	}
	w.Header().Set("Location", loc)
	w.WriteHeader(http.StatusMovedPermanently)
	return nil
}

// serveConsoleFile writes one embedded file. Revalidated on every load,
// so a new binary's page replaces the old at once.
func serveConsoleFile(w http.ResponseWriter, name string) error {
	b, err := fs.ReadFile(consoleAssets, "console/"+name)
	if err != nil {
		return caddyhttp.Error(http.StatusInternalServerError, fmt.Errorf("sluice_console: reading %s: %w", name, err))
	}
	w.Header().Set("Content-Type", consoleFiles[name])
	w.Header().Set("Cache-Control", "no-cache")
	if _, err := w.Write(b); err != nil {
		return fmt.Errorf("sluice_console: writing %s: %w", name, err)
	}
	return nil
}

// ConsoleLookup is the answer of <mount>/api/lookup: the query as the
// node matches it and the node's answer (status.go's Lookup).
type ConsoleLookup struct {
	Query  map[string]string `json:"query"`
	Lookup Lookup            `json:"lookup"`
}

// serveLookup answers one host=, name=, server_name= or port= question
// from the route table, read only, as GET /sluice/lookup does.
func (c *Console) serveLookup(w http.ResponseWriter, r *http.Request) error {
	q, shown, err := parseLookup(r.URL.Query())
	if err != nil {
		return writeJSON(w, http.StatusBadRequest, map[string]string{"error": err.Error()})
	}
	return writeJSON(w, http.StatusOK, ConsoleLookup{Query: shown, Lookup: c.node.lookup(q)})
}

// ConsoleState is the answer of <mount>/api/state: one snapshot the page
// renders whole.
type ConsoleState struct {
	Now      time.Time       `json:"now"`
	Node     ConsoleNode     `json:"node"`
	Limits   LimitsStatus    `json:"limits"`
	Totals   TotalsStatus    `json:"totals"`
	Refusals ConsoleRefusals `json:"refusals"`
	Agents   []ConsoleAgent  `json:"agents"`
	Routes   ConsoleRoutes   `json:"routes"`
}

// ConsoleNode is the node itself.
type ConsoleNode struct {
	ID      string `json:"id"`
	Build   string `json:"build"`
	Caddy   string `json:"caddy"`
	Listen  string `json:"listen"`
	Address string `json:"address,omitempty"`
	TLS     bool   `json:"tls"`
	// ServingSince is when the node started serving (node.serve); zero
	// before it serves. Uptime is Now minus it.
	ServingSince  time.Time `json:"serving_since"`
	UptimeSeconds int64     `json:"uptime_seconds"`
	Ready         bool      `json:"ready"`
	Reason        string    `json:"reason,omitempty"`
	Draining      bool      `json:"draining"`
}

// ConsoleRefusals are the node's refusal counters since it started, by
// reason, as its metrics count them (metrics.go's nodeCounters).
type ConsoleRefusals struct {
	// Limits: client connections and requests a limit refused.
	Limits map[string]int64 `json:"limits"`
	// Streams: authenticated agent streams refused.
	Streams map[string]int64 `json:"streams"`
	// RoutesRejected: advertised routes admission rejected.
	RoutesRejected map[string]int64 `json:"routes_rejected"`
	// AuthFailures: agent streams refused for their credential.
	AuthFailures int64 `json:"auth_failures"`
}

// ConsoleAgent is one agent session, as status.go's SessionStatus, and
// the bytes of its open connections.
type ConsoleAgent struct {
	SessionStatus
	// BytesToClients and BytesFromClients are the payload bytes the
	// session carried: its ended connections' (node.connEnded) and its
	// open ones' so far (tunnelcore.Conn.Counts). A connection between
	// leaving the session and its end being counted is in neither for a
	// moment, so the page, which takes the rate from successive
	// snapshots, counts a fall as no traffic.
	BytesToClients   int64 `json:"bytes_to_clients"`
	BytesFromClients int64 `json:"bytes_from_clients"`
}

// ConsoleRoutes are the route tables, each key with the agent it resolves
// to now (the first of its candidates, under the default lb_policy) and
// the others that stand by.
type ConsoleRoutes struct {
	Hosts     []ConsoleRoute `json:"hosts"`
	Patterns  []ConsoleRoute `json:"patterns"`
	CatchAll  []ConsoleRoute `json:"catch_all"`
	TCPNames  []ConsoleRoute `json:"tcp_names"`
	SNI       []ConsoleRoute `json:"sni"`
	PortRoute []ConsoleRoute `json:"port_routes"` // listen-port routes a layer4 server of the config serves
	Ports     []PortStatus   `json:"ports"`       // ports the node binds (tcp_port_range)
}

// ConsoleRoute is one key of a route table.
type ConsoleRoute struct {
	Key    string   `json:"key"` // host, pattern, name, server name or port; "*" for the catch-all
	Kind   string   `json:"kind"`
	Agent  string   `json:"agent"`
	Route  string   `json:"route"`
	Others []string `json:"others"`
}

// state snapshots the node for the page.
func (c *Console) state(now time.Time) ConsoleState {
	n := c.node
	st := n.status()
	since := n.servingSince()
	cn := ConsoleNode{
		ID: st.ID, Build: tunnelpb.Build("sluice-node", ""), Caddy: caddyVersion(), Listen: st.Listen,
		Address: st.Address, TLS: st.TLS, ServingSince: since, Ready: st.Ready, Reason: st.Reason, Draining: st.Draining,
	}
	if !since.IsZero() {
		cn.UptimeSeconds = int64(now.Sub(since) / time.Second)
	}
	return ConsoleState{
		Now: now.UTC(), Node: cn, Limits: st.Limits, Totals: st.Totals, Refusals: n.refusals(),
		Agents: consoleAgents(n, st.Sessions), Routes: n.consoleRoutes(st.Ports),
	}
}

// caddyVersion is Caddy's short version string.
func caddyVersion() string {
	simple, _ := caddy.Version()
	return simple
}

func (n *node) refusals() ConsoleRefusals {
	m := &n.metrics
	r := ConsoleRefusals{Limits: map[string]int64{}, Streams: map[string]int64{}, RoutesRejected: map[string]int64{},
		AuthFailures: n.authFailures.Load()}
	for i, name := range limitReasonNames {
		r.Limits[name] = m.limitRefused[i].Load()
	}
	for i, name := range streamRefusalNames {
		r.Streams[name] = m.streamsRefused[i].Load()
	}
	for i, name := range routeRejectNames {
		r.RoutesRejected[name] = m.routesRejected[i].Load()
	}
	return r
}

// consoleAgents adds the open connections' bytes to each session of ss;
// a session that ended since the snapshot counts none.
func consoleAgents(n *node, ss []SessionStatus) []ConsoleAgent {
	bytes := map[string][2]int64{}
	for _, a := range n.reg.sessions() {
		toClients, fromClients := a.endedToClients.Load(), a.endedFromClients.Load()
		for _, conn := range a.sess.Conns() {
			read, written := conn.Counts()
			toClients, fromClients = toClients+read, fromClients+written
		}
		key := a.agentID + "\x00" + a.connected.UTC().String()
		b := bytes[key]
		bytes[key] = [2]int64{b[0] + toClients, b[1] + fromClients}
	}
	out := make([]ConsoleAgent, 0, len(ss))
	for _, s := range ss {
		b := bytes[s.AgentID+"\x00"+s.ConnectedSince.String()]
		out = append(out, ConsoleAgent{SessionStatus: s, BytesToClients: b[0], BytesFromClients: b[1]})
	}
	return out
}

// consoleRoutes lists the current route table by key, each key's
// candidates in the order a lookup takes them; ports are the node's
// claims.
func (n *node) consoleRoutes(ports []PortStatus) ConsoleRoutes {
	t := n.reg.table.Load()
	out := ConsoleRoutes{Ports: ports}
	for _, host := range t.exact.keys() {
		out.Hosts = append(out.Hosts, tableRow(host, t.exact.get(host)))
	}
	out.Patterns = patternRows(t.patterns.entries)
	if len(t.catchAll) > 0 {
		out.CatchAll = []ConsoleRoute{tableRow("*", t.catchAll)}
	}
	for _, name := range t.byName.keys() {
		if named := kindOnly(t.byName.get(name), route.NamedTCP); len(named) > 0 {
			out.TCPNames = append(out.TCPNames, tableRow(name, named))
		}
	}
	for _, sni := range t.sniExact.keys() {
		out.SNI = append(out.SNI, tableRow(sni, t.sniExact.get(sni)))
	}
	out.SNI = append(out.SNI, patternRows(t.sniPatterns.entries)...)
	claimed := map[uint32]bool{}
	for _, p := range ports {
		claimed[p.Port] = claimed[p.Port] || p.Network == "" // the TCP ports' rows
	}
	for _, port := range t.byPort.keys() {
		if !claimed[port] {
			out.PortRoute = append(out.PortRoute, tableRow(fmt.Sprint(port), t.byPort.get(port)))
		}
	}
	out.nonNil()
	return out
}

// nonNil makes empty tables [] in the JSON, so the page need not tell
// null from none.
func (r *ConsoleRoutes) nonNil() {
	for _, s := range []*[]ConsoleRoute{&r.Hosts, &r.Patterns, &r.CatchAll, &r.TCPNames, &r.SNI, &r.PortRoute} {
		if *s == nil {
			*s = []ConsoleRoute{}
		}
	}
	if r.Ports == nil {
		r.Ports = []PortStatus{}
	}
}

// kindOnly returns the entries of es of kind k.
func kindOnly(es []*routeEntry, k route.Kind) []*routeEntry {
	var out []*routeEntry
	for _, e := range es {
		if e.kind == k {
			out = append(out, e)
		}
	}
	return out
}

// patternRows groups pattern entries (in lookup order) by pattern, in the
// order each pattern first appears.
func patternRows(es []*routeEntry) []ConsoleRoute {
	var order []string
	by := map[string][]*routeEntry{}
	for _, e := range es {
		src := e.route.GetHostPattern()
		if _, ok := by[src]; !ok {
			order = append(order, src)
		}
		by[src] = append(by[src], e)
	}
	out := make([]ConsoleRoute, 0, len(order))
	for _, src := range order {
		out = append(out, tableRow(src, by[src]))
	}
	return out
}

// tableRow is one key and its candidates, the first of which serves it.
func tableRow(key string, es []*routeEntry) ConsoleRoute {
	row := ConsoleRoute{Key: key, Others: []string{}}
	if len(es) == 0 {
		return row
	}
	row.Kind, row.Agent, row.Route = es[0].kind.String(), es[0].agent.agentID, routeName(es[0].route)
	for _, e := range es[1:] {
		row.Others = append(row.Others, e.agent.agentID)
	}
	return row
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	sluice_console
//
// It takes no arguments and no block. Mount it under any path and put
// Caddy's authentication in front of it:
//
//	handle_path /console/* {
//		basic_auth {
//			admin <bcrypt hash from `caddy hash-password`>
//		}
//		sluice_console
//	}
//
// The handler needs no prefix option: it serves by the last segments of
// the request path (…/ is the page, …/app.js and …/style.css its files,
// …/api/state the JSON snapshot, …/api/lookup?host=|name=|server_name=|port=
// the route finder), and the page uses relative URLs, so the same config
// works with handle_path (prefix stripped) and route or handle (kept).
// A request for the mount path without its final slash that reaches the
// handler as / (`handle_path /console*` strips /console to /) is
// redirected to the path with the slash.
func (c *Console) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		return d.Errf("sluice_console: takes no arguments, got %q (mount it with handle_path or route)", d.Val())
	}
	if d.NextBlock(0) {
		return d.Errf("sluice_console: takes no block, got %q", d.Val())
	}
	return nil
}

// parseConsoleDirective parses the sluice_console directive.
func parseConsoleDirective(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	c := new(Console)
	if err := c.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return c, nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Console)(nil)
	_ caddyhttp.MiddlewareHandler = (*Console)(nil)
	_ caddyfile.Unmarshaler       = (*Console)(nil)
)

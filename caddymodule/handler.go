package caddymodule

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"
	"golang.org/x/net/http/httpguts"

	"github.com/sluice-tunnel/sluice/internal/hostname"
)

func init() {
	caddy.RegisterModule(Handler{})
}

// DefaultStreamCloseDelay keeps WebSockets and other upgraded connections
// open across config reloads: reverse_proxy closes them when its config is
// unloaded unless stream_close_delay is set.
const DefaultStreamCloseDelay = 24 * time.Hour

// Handler is reverse_proxy preconfigured for tunnels: upstreams are the
// agents serving the request's host (dynamic upstreams `sluice`), every
// connection to them is a virtual connection (transport `sluice`), the
// smallest agent id serves by default (lb_policy `first`), upgraded
// connections survive config reloads, and a host no agent serves gets a 503
// that says so (after waiting up to lb_try_duration for an agent to come,
// when that is set). Every reverse_proxy option applies.
//
// Client addresses. Routes' allowed_cidrs are judged on the address Caddy
// reports as the client's ({client_ip}, the same the client_ip matcher and
// the access log use): the connection's peer, unless that peer is one of
// the server's trusted_proxies, when it is read from client_ip_headers
// (default X-Forwarded-For). Under the server's trusted_proxies_strict that
// is the rightmost address that is not a trusted proxy, the hop the proxy
// saw; without it Caddy takes the leftmost, which the client wrote itself
// and a proxy that appends passes on, so a site whose routes set
// allowed_cidrs behind proxies wants trusted_proxies_strict (the handler
// warns once when it judges such a request without it). A client that is
// not a trusted proxy cannot move its address with headers.
//
// Forwarding headers. reverse_proxy discards the X-Forwarded-For, -Proto
// and -Host a client sent unless the client is a trusted proxy, and sets
// its own. The handler discards, on the same condition, the other two
// headers upstreams read a client address from, Forwarded and X-Real-IP
// (with X_Real_IP and X.Real.IP, which CGI-style frameworks read as the
// same header, should the server let them in): a client that is not the
// server's or this handler's trusted proxy cannot pass for another address
// with them, unless keep_forwarded_headers is set. header_up applies after
// the removal, so `header_up X-Real-IP {client_ip}` sets the header from
// the address Caddy trusts.
//
// Header allow-list. With forward_headers set, only the request headers it
// names cross to the agent's upstream, as the edge relay of the reference
// does: cookies, credentials and whatever else a caller invents stop at the
// edge unless listed (see ForwardHeaders for what HTTP itself needs and
// always passes). header_up applies after the allow-list and may add any
// header, including from a dropped one ({http.request.header.*} reads the
// request as the client sent it).
//
// Deadline before the response head. An exchange that waits for its
// response head longer than response_header_timeout (default 60 s; see
// StreamPolicy) is answered 504 Gateway Timeout: an upstream that accepts
// and never answers cannot hold a client for good. A stream whose head came
// is not cut by it, and gRPC calls, whose server streams may send their
// head with their first message, are exempt.
type Handler struct {
	reverseproxy.Handler
	StreamPolicy

	// KeepForwardedHeaders passes the Forwarded and X-Real-IP headers of
	// every client to the upstream, trusted proxy or not. Set it only when
	// the upstream does not take them as the client's address, or when
	// every client is trusted (a proxy in front that rewrites them).
	KeepForwardedHeaders bool `json:"keep_forwarded_headers,omitempty"`

	// ForwardHeaders, when set, is the allow-list of request headers
	// (names, case-insensitive) that cross to the agent's upstream; the
	// others are dropped. Unset: every header crosses (less reverse_proxy's
	// hop-by-hop ones and the forwarding headers above). An empty list
	// lets none of the client's own headers cross.
	//
	// What HTTP needs crosses whatever the list says: the Host (the
	// request's authority, which routes the request); the headers that
	// describe the body, which crosses (Content-Type, Content-Encoding,
	// Content-Length; the framing of the body is the transport's own);
	// the hop-by-hop Connection, Upgrade and TE, which reverse_proxy
	// strips but for an upgrade and gRPC's "TE: trailers"; on an upgrade
	// request (a WebSocket), its handshake (Sec-WebSocket-Key, -Version,
	// -Protocol, -Extensions, and HTTP/2's :protocol); and X-Forwarded-For,
	// -Proto and -Host, which reverse_proxy replaces for a client that is
	// not a trusted proxy and extends for one (`header_up -X-Forwarded-For`
	// removes them), as it adds its own Via after the list.
	// Forwarded and X-Real-IP cross only when listed, and then under the
	// rule above.
	ForwardHeaders *[]string `json:"forward_headers,omitempty"`

	app    *App
	logger *zap.Logger
	// forward is ForwardHeaders by canonical name; nil: every header
	// crosses.
	forward map[string]struct{}
	// trustedProxies is reverse_proxy's trusted_proxies, parsed: requests
	// from them keep their forwarding headers, as their X-Forwarded-*.
	trustedProxies []netip.Prefix
	// laxClientIPWarn logs the trusted_proxies_strict warning once.
	laxClientIPWarn *sync.Once
	// rpProvisioned: the embedded reverse_proxy got as far as making its
	// connection table, which its Cleanup locks (a nil mutex panics, and a
	// panic during a config load takes Caddy down).
	rpProvisioned bool
}

// CaddyModule returns the Caddy module information.
func (Handler) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.sluice",
		New: func() caddy.Module { return new(Handler) },
	}
}

// Provision fills in the tunnel defaults, then provisions reverse_proxy.
func (h *Handler) Provision(ctx caddy.Context) error {
	if len(h.Upstreams) > 0 {
		return fmt.Errorf("sluice: upstreams: static upstreams are not allowed; agents are the upstreams")
	}
	if h.DynamicUpstreamsRaw == nil {
		h.DynamicUpstreamsRaw = caddyconfig.JSONModuleObject(Upstreams{}, "source", "sluice", nil)
	} else if src := moduleName(h.DynamicUpstreamsRaw, "source"); src != "sluice" {
		return fmt.Errorf("sluice: dynamic_upstreams: must be `sluice`, got %q", src)
	}
	if h.TransportRaw == nil {
		h.TransportRaw = caddyconfig.JSONModuleObject(Transport{}, "protocol", "sluice", nil)
	} else if p := moduleName(h.TransportRaw, "protocol"); p != "sluice" {
		return fmt.Errorf("sluice: transport: must be `sluice`, got %q", p)
	}
	if h.HealthChecks != nil && h.HealthChecks.Active != nil {
		// Caddy runs active checks on static upstreams only: they would
		// never run. A session that ends leaves the table at once, and
		// passive checks (fail_duration, ...) apply.
		return fmt.Errorf("sluice: health_checks: active health checks (health_uri, health_port, ...) never run on agents; use passive ones (fail_duration, max_fails, unhealthy_status)")
	}
	if h.LoadBalancing == nil {
		h.LoadBalancing = &reverseproxy.LoadBalancing{}
	}
	if h.LoadBalancing.SelectionPolicyRaw == nil {
		h.LoadBalancing.SelectionPolicyRaw = caddyconfig.JSONModuleObject(reverseproxy.FirstSelection{}, "policy", "first", nil)
	}
	if h.StreamCloseDelay == 0 {
		h.StreamCloseDelay = caddy.Duration(DefaultStreamCloseDelay)
	}
	if err := h.StreamPolicy.validate(); err != nil {
		return err
	}
	if err := h.parseTrustedProxies(); err != nil {
		return err
	}
	if err := h.provisionForwardHeaders(); err != nil {
		return err
	}
	app, err := sluiceApp(ctx)
	if err != nil {
		return err
	}
	h.app = app
	h.logger = ctx.Logger().With(zap.String("node_id", app.NodeID)) // as the node's own lines
	h.laxClientIPWarn = new(sync.Once)
	// reverse_proxy's Provision makes its connection table right after
	// loading the events app; load that first so a failure there is ours.
	if _, err := ctx.App("events"); err != nil {
		return fmt.Errorf("sluice: getting events app: %w", err)
	}
	h.rpProvisioned = true
	return h.Handler.Provision(ctx)
}

// Cleanup cleans up the embedded reverse_proxy if its Provision ran. Caddy
// calls Cleanup after a failed Provision too: a config whose sluice app
// fails to load (a bad token_file, a refused tls change) must be refused,
// not crash the running server.
func (h *Handler) Cleanup() error {
	if !h.rpProvisioned {
		return nil
	}
	return h.Handler.Cleanup()
}

// ServeHTTP answers 503 with a readable body when no agent serves the host,
// and proxies otherwise.
func (h *Handler) ServeHTTP(w http.ResponseWriter, r *http.Request, next caddyhttp.Handler) error {
	n := h.app.node
	host, ok := hostname.RoutingKey(r.Host)
	if !ok {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusBadRequest)
		io.WriteString(w, "400 Bad Request: the Host header is not a valid host name or address\n")
		return nil
	}
	// max_connections is not checked here: a request that reuses an idle
	// pooled connection takes no new slot. A dial that finds every slot
	// taken marks the exchange, and serveWithPolicy answers 503.
	release, ok := n.clients.acquire(r.RemoteAddr, n.opts.Load().maxConnsPerAddr)
	if !ok {
		return h.limited(w, r, "max_connections_per_address")
	}
	defer release()
	routes := n.reg.table.Load().lookupHTTP(host)
	if len(routes) == 0 && h.LoadBalancing.TryDuration > 0 {
		n.awaitingAgent.Add(1)
		routes = n.reg.awaitHTTP(r.Context(), host, time.Duration(h.LoadBalancing.TryDuration))
		n.awaitingAgent.Add(-1)
	}
	h.warnLaxClientIP(r, routes)
	if len(routes) > 0 && len(allowedFor(routes, clientAddr(r))) == 0 {
		n.logLimit("http", "allowed_cidrs", clientAddr(r))
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.WriteHeader(http.StatusForbidden)
		fmt.Fprintf(w, "403 Forbidden: your address may not use the tunnel for %s\n", host)
		return nil
	}
	if len(routes) == 0 {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		w.Header().Set("Cache-Control", "no-store")
		w.Header().Set("Retry-After", "5")
		w.WriteHeader(http.StatusServiceUnavailable)
		fmt.Fprintf(w, "503 Service Unavailable: no sluice agent is connected for %s\n", host)
		return nil
	}
	r = h.withoutClientForwarding(r)
	return h.serveWithPolicy(w, r, func(w http.ResponseWriter, r *http.Request) error {
		// The allow-list applies here, after the stream policy
		// classified the request on the client's own Accept.
		return h.Handler.ServeHTTP(w, h.withForwardHeaders(r), next)
	})
}

// provisionForwardHeaders checks forward_headers and indexes it.
func (h *Handler) provisionForwardHeaders() error {
	h.forward = nil
	if h.ForwardHeaders == nil {
		return nil
	}
	h.forward = make(map[string]struct{}, len(*h.ForwardHeaders))
	for _, name := range *h.ForwardHeaders {
		if !httpguts.ValidHeaderFieldName(name) {
			return fmt.Errorf("sluice: forward_headers: %q is not a header name", name)
		}
		h.forward[http.CanonicalHeaderKey(name)] = struct{}{}
	}
	return nil
}

// alwaysForwarded reports whether the header of canonical name ck crosses
// whatever forward_headers says (see Handler.ForwardHeaders for why).
func alwaysForwarded(ck string) bool {
	switch ck {
	case "Content-Type", "Content-Encoding", "Content-Length",
		"Connection", "Upgrade", "Te",
		"X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host":
		return true
	}
	return false
}

// upgradeHandshake reports whether the header of canonical name ck is one
// of the WebSocket handshake's, which cross on an upgrade request whatever
// forward_headers says.
func upgradeHandshake(ck string) bool {
	switch ck {
	case "Sec-Websocket-Key", "Sec-Websocket-Version", "Sec-Websocket-Protocol", "Sec-Websocket-Extensions":
		return true
	}
	return false
}

// forwards reports whether header k crosses under forward_headers.
func (h *Handler) forwards(k string, upgrade bool) bool {
	if strings.HasPrefix(k, ":") {
		return true // an HTTP/2 pseudo-header (extended CONNECT's :protocol)
	}
	ck := http.CanonicalHeaderKey(k)
	if _, ok := h.forward[ck]; ok {
		return true
	}
	return alwaysForwarded(ck) || (upgrade && upgradeHandshake(ck))
}

// withForwardHeaders returns r with only the headers forward_headers lets
// cross (r itself when it is unset or every header may). The headers are
// removed from a copy: the access log and placeholders see the request as
// the client sent it.
func (h *Handler) withForwardHeaders(r *http.Request) *http.Request {
	if h.forward == nil {
		return r
	}
	upgrade := r.Header.Get("Upgrade") != "" || r.Method == http.MethodConnect
	var r2 *http.Request
	for k := range r.Header {
		if h.forwards(k, upgrade) {
			continue
		}
		if r2 == nil {
			r2 = r.WithContext(r.Context())
			r2.Header = r.Header.Clone()
		}
		delete(r2.Header, k)
	}
	if r2 == nil {
		return r
	}
	return r2
}

// parseTrustedProxies parses reverse_proxy's trusted_proxies ahead of
// reverse_proxy's own Provision, so a bad entry is reported with the field.
func (h *Handler) parseTrustedProxies() error {
	h.trustedProxies = h.trustedProxies[:0]
	for _, s := range h.TrustedProxies {
		p, err := caddyhttp.CIDRExpressionToPrefix(s)
		if err != nil {
			return fmt.Errorf("sluice: trusted_proxies: %w", err)
		}
		h.trustedProxies = append(h.trustedProxies, p)
	}
	return nil
}

// withoutClientForwarding returns r without the Forwarded and X-Real-IP
// headers when they may not pass (see Handler). The headers are removed
// from a copy: the access log records the request as the client sent it.
func (h *Handler) withoutClientForwarding(r *http.Request) *http.Request {
	if h.KeepForwardedHeaders || !hasClientForwarding(r.Header) || h.fromTrustedProxy(r) {
		return r
	}
	r2 := r.WithContext(r.Context())
	r2.Header = r.Header.Clone()
	for k := range r2.Header {
		if isClientForwardingHeader(k) {
			delete(r2.Header, k)
		}
	}
	return r2
}

// hasClientForwarding reports whether hdr holds a header
// withoutClientForwarding removes: most requests have none and are not
// copied.
func hasClientForwarding(hdr http.Header) bool {
	for k := range hdr {
		if isClientForwardingHeader(k) {
			return true
		}
	}
	return false
}

// isClientForwardingHeader reports whether a header field name is Forwarded
// or X-Real-IP in any case, with '_' or '.' for '-' too: CGI-style
// frameworks fold them all into HTTP_X_REAL_IP. (Caddy drops such names
// unless the server's expected_underscore_headers or expected_dot_headers
// list them.)
func isClientForwardingHeader(name string) bool {
	if len(name) != len("Forwarded") { // = len("X-Real-IP")
		return false
	}
	return strings.EqualFold(name, "Forwarded") || strings.EqualFold(strings.Map(dashFold, name), "X-Real-IP")
}

// dashFold maps the separators CGI-style frameworks fold together to '-'.
func dashFold(r rune) rune {
	if r == '_' || r == '.' {
		return '-'
	}
	return r
}

// fromTrustedProxy reports whether the request's peer is a trusted proxy:
// the server's trusted_proxies (as Caddy decided) or this handler's, the
// same test reverse_proxy applies to X-Forwarded-*.
func (h *Handler) fromTrustedProxy(r *http.Request) bool {
	if trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool); trusted {
		return true
	}
	if len(h.trustedProxies) == 0 {
		return false
	}
	host, _, err := net.SplitHostPort(r.RemoteAddr)
	if err != nil {
		return false
	}
	host, _, _ = strings.Cut(host, "%")
	ip, err := netip.ParseAddr(host)
	if err != nil {
		return false
	}
	for _, p := range h.trustedProxies {
		if p.Contains(ip) {
			return true
		}
	}
	return false
}

// laxClientIPMsg is the message of warnLaxClientIP's line.
const laxClientIPMsg = "allowed_cidrs judged behind a trusted proxy without trusted_proxies_strict"

// warnLaxClientIP warns once when allowed_cidrs are judged on an address a
// trusted proxy passed on while the server lacks trusted_proxies_strict:
// Caddy then takes the leftmost client_ip_headers entry, which the client
// may have written itself.
func (h *Handler) warnLaxClientIP(r *http.Request, routes []*routeEntry) {
	if trusted, _ := caddyhttp.GetVar(r.Context(), caddyhttp.TrustedProxyVarKey).(bool); !trusted {
		return
	}
	srv, _ := r.Context().Value(caddyhttp.ServerCtxKey).(*caddyhttp.Server)
	if srv == nil || srv.TrustedProxiesStrict > 0 {
		return
	}
	if !slices.ContainsFunc(routes, func(e *routeEntry) bool { return len(e.allowed) > 0 }) {
		return
	}
	h.laxClientIPWarn.Do(func() {
		h.logger.Warn(laxClientIPMsg, zap.String("client_ip", clientAddr(r)), zap.String("remote_addr", r.RemoteAddr),
			zap.String("fix", "set trusted_proxies_strict in the server's options: allowed_cidrs are judged on the leftmost client_ip_headers address a trusted proxy passed on, which the client can write; strict takes the rightmost hop that is not a trusted proxy"))
	})
}

// limited answers a request refused by a connection limit: 503 with
// Retry-After, counted and logged through the throttle.
func (h *Handler) limited(w http.ResponseWriter, r *http.Request, limit string) error {
	h.app.node.logLimit("http", limit, r.RemoteAddr)
	answerLimited(w, limit)
	return nil
}

func answerLimited(w http.ResponseWriter, limit string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.Header().Set("Retry-After", "1")
	w.WriteHeader(http.StatusServiceUnavailable)
	fmt.Fprintf(w, "503 Service Unavailable: the tunnel is at its connection limit (%s); retry shortly\n", limit)
}

// moduleName reads the inline module name (e.g. "protocol") of a raw module.
func moduleName(raw json.RawMessage, key string) string {
	var m map[string]any
	if json.Unmarshal(raw, &m) != nil {
		return ""
	}
	s, _ := m[key].(string)
	return s
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Handler)(nil)
	_ caddy.CleanerUpper          = (*Handler)(nil)
	_ caddyhttp.MiddlewareHandler = (*Handler)(nil)
)

package caddymodule

import (
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"
	"go.uber.org/zap"

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
type Handler struct {
	reverseproxy.Handler
	StreamPolicy

	app    *App
	logger *zap.Logger
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
	app, err := sluiceApp(ctx)
	if err != nil {
		return err
	}
	h.app = app
	h.logger = ctx.Logger()
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
	if len(routes) > 0 && len(allowedFor(routes, clientAddr(r))) == 0 {
		n.logLimit("http", "allowed_cidrs", r.RemoteAddr)
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
	return h.serveWithPolicy(w, r, func(w http.ResponseWriter, r *http.Request) error {
		return h.Handler.ServeHTTP(w, r, next)
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

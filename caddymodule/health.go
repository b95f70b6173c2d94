package caddymodule

import (
	"encoding/json"
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
)

func init() {
	caddy.RegisterModule(Health{})
	httpcaddyfile.RegisterHandlerDirective("sluice_health", parseHealthDirective)
	// Like respond, which it is a kind of: it answers and ends the chain.
	httpcaddyfile.RegisterDirectiveOrder("sluice_health", httpcaddyfile.Before, "respond")
}

// Health answers a load balancer's probe for the node of this config's
// sluice app, on a site of its own choosing: the admin API, which reports
// the same (GET /sluice/ready), usually listens on localhost only. It
// answers and ends the handler chain, 200 or 503 with a small JSON body
// ({"status":"ready"}, {"status":"not_ready","reason":"draining"}).
//
// Readiness is down while the node drains (from the moment the process
// begins to exit), until its control listener serves and its warmup has
// passed (agents connect before traffic comes), and while the site's
// server is shutting down (Caddy's shutdown_delay, {http.shutting_down}):
// a load balancer routes around the node before its listeners close. Put
// it behind a matcher for the probe's path, e.g. `handle /ready {
// sluice_health }`.
type Health struct {
	// Check is what the answer says: "ready" (default; the node takes
	// agents and traffic) or "live" (the process serves: always 200).
	Check string `json:"check,omitempty"`

	node *node
}

// Health checks.
const (
	checkReady = "ready"
	checkLive  = "live"
)

// CaddyModule returns the Caddy module information.
func (Health) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.handlers.sluice_health",
		New: func() caddy.Module { return new(Health) },
	}
}

// Provision finds the node of the config's sluice app.
func (h *Health) Provision(ctx caddy.Context) error {
	if h.Check == "" {
		h.Check = checkReady
	}
	app, err := configuredSluiceApp(ctx, "sluice_health")
	if err != nil {
		return err
	}
	h.node = app.node
	return nil
}

// configuredSluiceApp returns the config's sluice app for a handler that
// only looks at it (a probe, the console), and an error naming who when
// the config has none: loading one would start a control plane nobody
// configured.
func configuredSluiceApp(ctx caddy.Context, who string) (*App, error) {
	appAny, err := ctx.AppIfConfigured("sluice")
	if err != nil {
		return nil, fmt.Errorf("%s: needs the sluice app (a global `sluice` block): %w", who, err)
	}
	return appAny.(*App), nil
}

// Validate refuses an unknown check.
func (h *Health) Validate() error {
	if h.Check != checkReady && h.Check != checkLive {
		return fmt.Errorf("sluice_health: check: want %q or %q, got %q", checkReady, checkLive, h.Check)
	}
	return nil
}

// healthBody is the handler's answer.
type healthBody struct {
	Status string `json:"status"` // live, ready or not_ready
	Reason string `json:"reason,omitempty"`
}

// ServeHTTP implements caddyhttp.MiddlewareHandler. It never calls next.
func (h *Health) ServeHTTP(w http.ResponseWriter, r *http.Request, _ caddyhttp.Handler) error {
	body, code := healthBody{Status: checkLive}, http.StatusOK
	if h.Check == checkReady {
		body.Status = checkReady
		if ready, reason := h.ready(r); !ready {
			body, code = healthBody{Status: "not_ready", Reason: reason}, http.StatusServiceUnavailable
		}
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	if err := json.NewEncoder(w).Encode(body); err != nil {
		return fmt.Errorf("sluice_health: writing the answer: %w", err)
	}
	return nil
}

// ready is the node's readiness, and down while r's server is shutting
// down: its listeners close at the end of shutdown_delay.
func (h *Health) ready(r *http.Request) (bool, string) {
	if ready, reason := h.node.readiness(); !ready {
		return false, reason
	}
	if repl, ok := r.Context().Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		if down, _ := repl.Get("http.shutting_down"); down == true {
			return false, "server shutting down"
		}
	}
	return true, ""
}

// UnmarshalCaddyfile sets up the handler from Caddyfile tokens. Syntax:
//
//	sluice_health [ready|live]
//
// ready (the default) answers 200 while the node serves and does not
// drain, else 503; live answers 200 while the process serves.
func (h *Health) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // directive name
	if d.NextArg() {
		switch v := d.Val(); v {
		case checkReady, checkLive:
			h.Check = v
		default:
			return d.Errf("sluice_health: want ready or live, got %q", v)
		}
	}
	if d.NextArg() {
		return d.Errf("sluice_health: takes one argument, ready or live; got another: %q", d.Val())
	}
	if d.NextBlock(0) {
		return d.Errf("sluice_health: takes no block, got %q", d.Val())
	}
	return nil
}

// parseHealthDirective parses the sluice_health directive.
func parseHealthDirective(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	hh := new(Health)
	if err := hh.UnmarshalCaddyfile(h.Dispenser); err != nil {
		return nil, err
	}
	return hh, nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Health)(nil)
	_ caddy.Validator             = (*Health)(nil)
	_ caddyhttp.MiddlewareHandler = (*Health)(nil)
	_ caddyfile.Unmarshaler       = (*Health)(nil)
)

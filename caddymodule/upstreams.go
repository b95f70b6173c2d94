package caddymodule

import (
	"fmt"
	"net/http"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	"github.com/sluice-tunnel/sluice/internal/hostname"
)

func init() {
	caddy.RegisterModule(Upstreams{})
}

// Upstreams is a dynamic upstream source that returns one upstream per
// agent route serving the request's host: the exact-host routes if any,
// else the matching host patterns, else the catch-all routes, each ordered
// by agent id (a host some agent serves exactly never falls through to a
// pattern or catch-all agent). With none, reverse_proxy answers 503. The
// sluice directive has it built in; `dynamic sluice` uses it in a plain
// reverse_proxy (with `transport sluice`).
type Upstreams struct {
	app *App
}

// CaddyModule returns the Caddy module information.
func (Upstreams) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.upstreams.sluice",
		New: func() caddy.Module { return new(Upstreams) },
	}
}

// Provision finds the sluice app.
func (u *Upstreams) Provision(ctx caddy.Context) error {
	app, err := sluiceApp(ctx)
	if err != nil {
		return err
	}
	u.app = app
	return nil
}

// GetUpstreams implements reverseproxy.UpstreamSource. The upstreams are
// allocated anew on every call: reverse_proxy mutates them.
func (u *Upstreams) GetUpstreams(r *http.Request) ([]*reverseproxy.Upstream, error) {
	host, ok := hostname.RoutingKey(r.Host)
	if !ok {
		return nil, nil // an invalid Host reaches no route, not even the catch-all
	}
	routes := allowedFor(u.app.node.reg.table.Load().lookupHTTP(host), clientAddr(r))
	ups := make([]*reverseproxy.Upstream, len(routes))
	for i, e := range routes {
		ups[i] = &reverseproxy.Upstream{Dial: e.dial + ":80"}
	}
	return ups, nil
}

// UnmarshalCaddyfile sets up the source from Caddyfile tokens. Syntax:
//
//	dynamic sluice
func (u *Upstreams) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // source name
	if d.NextArg() {
		return d.ArgErr()
	}
	if d.NextBlock(0) {
		return d.Errf("unrecognized sluice upstreams option %q", d.Val())
	}
	return nil
}

// sluiceApp returns the sluice app of ctx's config, provisioning a default
// one when the config has none.
func sluiceApp(ctx caddy.Context) (*App, error) {
	appAny, err := ctx.App("sluice")
	if err != nil {
		return nil, fmt.Errorf("loading sluice app: %w", err)
	}
	return appAny.(*App), nil
}

// Interface guards
var (
	_ caddy.Provisioner           = (*Upstreams)(nil)
	_ reverseproxy.UpstreamSource = (*Upstreams)(nil)
	_ caddyfile.Unmarshaler       = (*Upstreams)(nil)
)

// clientAddr is the address allowed_cidrs judge: the client's address as
// Caddy determined it ({client_ip}: the peer, or, from a trusted proxy, the
// client_ip_headers entry trusted_proxies_strict selects; see Handler),
// else the connection's remote address. A client that is not a trusted
// proxy cannot move it with X-Forwarded-For.
func clientAddr(r *http.Request) string {
	if ip, ok := caddyhttp.GetVar(r.Context(), caddyhttp.ClientIPVarKey).(string); ok && ip != "" {
		return ip
	}
	return r.RemoteAddr
}

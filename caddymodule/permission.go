package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddytls"

	"github.com/sluice-tunnel/sluice/internal/hostname"
	"github.com/sluice-tunnel/sluice/internal/route"
)

func init() {
	caddy.RegisterModule(PermissionBySluice{})
}

// PermissionBySluice allows Caddy's on-demand TLS a certificate only for a
// host some connected agent serves over HTTP right now: by an exact host
// (an http://, https:// or tcp:// route with a host) or by a host pattern
// that matches the name. The catch-all grants nothing (any name at all
// would get a certificate), and neither do TLS passthrough routes (their
// upstream terminates TLS), named TCP services or listen ports. Routes of
// an agent that is shutting down no longer count.
//
// It reads the route table of the config's sluice app at each check, so a
// host gets its certificate as soon as an agent advertises it. Caddy asks
// only when it has no certificate for the name in memory: one already
// obtained keeps being served after its agent left.
type PermissionBySluice struct {
	app *App
}

// CaddyModule returns the Caddy module information.
func (PermissionBySluice) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "tls.permission.sluice",
		New: func() caddy.Module { return new(PermissionBySluice) },
	}
}

// Provision finds the config's sluice app. Without one the config fails to
// load: loading a default app here would start a control plane nobody
// configured, and no agent could ever grant a certificate.
func (p *PermissionBySluice) Provision(ctx caddy.Context) error {
	app, err := configuredSluiceApp(ctx, "tls.permission.sluice")
	if err != nil {
		return err
	}
	p.app = app
	return nil
}

// UnmarshalCaddyfile sets up the module from Caddyfile tokens. It takes no
// arguments and no block. Syntax, in the global options:
//
//	on_demand_tls {
//		permission sluice
//	}
func (p *PermissionBySluice) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // module name
	if d.NextArg() {
		return d.Errf("permission sluice: takes no arguments, got %q", d.Val())
	}
	if d.NextBlock(0) {
		return d.Errf("permission sluice: takes no options, got %q", d.Val())
	}
	return nil
}

// CertificateAllowed implements caddytls.OnDemandPermission: nil when a
// connected agent serves name over HTTP (routeTable.servesCertificateFor).
// A refusal wraps caddytls.ErrPermissionDenied, so Caddy logs it as a
// denial (at debug level) rather than as a failure to ask.
func (p *PermissionBySluice) CertificateAllowed(_ context.Context, name string) error {
	if _, ok := certificateHost(name); !ok {
		return &certificateRefusal{name: name, invalid: true}
	}
	var n *node
	if p.app != nil {
		n = p.app.node
	}
	if n == nil {
		return errors.New("sluice: tls.permission.sluice: the sluice app has no node")
	}
	if !n.reg.table.Load().servesCertificateFor(name) {
		return &certificateRefusal{name: name}
	}
	return nil
}

// certificateRefusal says why a certificate was refused.
type certificateRefusal struct {
	name    string
	invalid bool // not a host name any route could serve
}

// maxRefusedNameShown bounds how much of a refused name the error echoes.
const maxRefusedNameShown = hostname.MaxLength + 1

func (e *certificateRefusal) Error() string {
	name := e.name
	if len(name) > maxRefusedNameShown {
		name = name[:maxRefusedNameShown] + "..."
	}
	if e.invalid {
		return fmt.Sprintf("sluice: %q is not a host name an agent can serve", name)
	}
	return fmt.Sprintf("sluice: no connected agent serves %q", name)
}

// Unwrap makes the refusal a caddytls.ErrPermissionDenied.
func (e *certificateRefusal) Unwrap() error { return caddytls.ErrPermissionDenied }

// certificateHost is the routing key of a certificate's name, as the route
// table keys hosts: lower case, without the trailing dot of a fully
// qualified name. ok is false for a name no route can serve (not a valid
// host name or IP address, or longer than hostname.MaxLength), which then
// never runs a pattern.
func certificateHost(name string) (host string, ok bool) {
	if len(name) > hostname.MaxLength+1 { // +1: a trailing dot
		return "", false
	}
	host = strings.TrimSuffix(strings.ToLower(name), ".")
	return host, hostname.ValidRoute(host)
}

// servesCertificateFor reports whether a route of the table serves name
// over HTTP by its exact host or by a host pattern matching it: the hosts
// on-demand TLS may get a certificate for. Leaving sessions' routes are in
// neither index. A name that is not a valid host name is served by none.
func (t *routeTable) servesCertificateFor(name string) bool {
	host, ok := certificateHost(name)
	if !ok {
		return false
	}
	if slices.ContainsFunc(t.exact.get(host), grantsCertificate) {
		return true
	}
	return slices.ContainsFunc(t.patterns.lookup(host), grantsCertificate)
}

// grantsCertificate reports whether e's kind takes HTTP for the hosts it
// names, the catch-all excepted: the kinds whose hosts may get an
// on-demand certificate. The table's exact and pattern indexes hold no
// other kind; this keeps a kind added to them later from granting
// certificates unawares.
func grantsCertificate(e *routeEntry) bool {
	switch e.kind {
	case route.Host, route.TCPHost, route.HostPattern, route.TCPHostPattern:
		return true
	}
	return false
}

// Interface guards
var (
	_ caddy.Module                = (*PermissionBySluice)(nil)
	_ caddy.Provisioner           = (*PermissionBySluice)(nil)
	_ caddyfile.Unmarshaler       = (*PermissionBySluice)(nil)
	_ caddytls.OnDemandPermission = (*PermissionBySluice)(nil)
)

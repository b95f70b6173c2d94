// Package caddymodule is sluice's server side as Caddy modules: the app
// `sluice` (the gRPC control plane agents dial, the session registry and the
// route table, shared across config reloads), the HTTP handler `sluice` (a
// reverse_proxy preconfigured for tunnels), the dynamic upstream source
// `http.reverse_proxy.upstreams.sluice` and the transport
// `http.reverse_proxy.transport.sluice` that dials virtual connections, the
// node's state on Caddy's admin API (`admin.api.sluice`: status, lookup,
// health, readiness, client certificate issuance), the probe handler
// `http.handlers.sluice_health`, the on-demand TLS permission
// `tls.permission.sluice`, the node's metrics in Caddy's registry, the
// `caddy sluice` command, and their Caddyfile syntax (the `sluice` global
// option, the `sluice` and `sluice_health` directives).
//
// Who may serve what is decided here too: agents authenticate with a
// credential (a token or a client certificate, credentials.go) whose scope
// bounds the routes they may advertise (scope.go).
//
// Nothing here knows the wire format: it reaches agents through
// tunnelcore.Session.
package caddymodule

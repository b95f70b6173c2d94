// Package sluice is the import xcaddy builds Caddy with:
//
//	xcaddy build --with github.com/sluice-tunnel/sluice --with github.com/mholt/caddy-l4
//
// It registers every sluice Caddy module: caddymodule (the app, the HTTP
// handler, upstreams and transport) and l4module (the caddy-l4 handler).
// The tunnel itself is tunnelcore; the agent is agent/cmd/sluice-agent.
package sluice

import (
	_ "github.com/sluice-tunnel/sluice/caddymodule"
	_ "github.com/sluice-tunnel/sluice/l4module"
)

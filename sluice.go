// Package sluice is the import xcaddy builds Caddy with:
//
//	xcaddy build --with github.com/sluice-tunnel/sluice
//
// It registers every sluice Caddy module. The code lives in caddymodule
// (app, HTTP handler, upstreams, transport) and tunnelcore (the tunnel);
// the agent is in agent/cmd/sluice-agent.
package sluice

import (
	_ "github.com/sluice-tunnel/sluice/caddymodule"
)

// Package integration holds sluice's full-stack tests: real Caddy with the
// sluice modules (in-process through caddy.Load of an adapted Caddyfile, and
// the xcaddy-built binary), real sluice-agents, real upstreams and real
// clients (curl, Go HTTP/1.1 and HTTP/2 clients, WebSocket). Every server
// binds loopback only; every wait is bounded.
package integration

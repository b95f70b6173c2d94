package caddymodule

import (
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// unmarshalCluster reads a `cluster { node <id> [<url>] ... }` block (see
// parseGlobalOption). A second block adds to the first, as repeated
// `sluice` blocks merge. The members are checked when the config loads
// (App.Provision), where JSON configs are checked too.
func (a *App) unmarshalCluster(d *caddyfile.Dispenser) error {
	if d.NextArg() {
		return d.Errf("sluice: cluster: takes no arguments, only a block of `node <id> <url>` lines")
	}
	if a.Cluster == nil {
		a.Cluster = &Cluster{}
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		if d.Val() != "node" {
			return d.Errf("sluice: cluster: unrecognized option %q (want node <id> <url>)", d.Val())
		}
		args := d.RemainingArgs()
		if len(args) < 1 || len(args) > 2 {
			return d.Errf("sluice: cluster: node: want <id> <url> (grpc://host:port or grpcs://host:port; this node may omit its url)")
		}
		cn := ClusterNode{ID: args[0]}
		if len(args) == 2 {
			cn.URL = args[1]
		}
		a.Cluster.Nodes = append(a.Cluster.Nodes, cn)
	}
	return nil
}

package agent

import (
	"context"
	"fmt"
	"net"
	"net/netip"
	"slices"
	"time"

	"go.uber.org/zap"
)

// With server_each_address, the server's DNS name is the cluster's
// membership: the agent resolves the name, keeps one link per address
// (the server's port; for grpcs:// the TLS server name and the
// :authority stay the name's), and resolves it again every
// server_refresh, opening links for new addresses and leaving those of
// addresses gone gracefully. A failed resolve keeps the links as they are.

// resolveFunc looks up the addresses of host, as net.Resolver.LookupNetIP
// does (network "ip").
type resolveFunc func(ctx context.Context, network, host string) ([]netip.Addr, error)

// resolveTimeout bounds one resolve of the server's name.
const resolveTimeout = 10 * time.Second

// runAddresses keeps a link per address of the server's name until ctx
// ends or the agent leaves. Until a resolve gave addresses it tries again
// with the reconnect backoff, not every server_refresh.
func (c *cluster) runAddresses(ctx context.Context) {
	bo := newBackoff(c.a.backoffInitial, c.a.backoffMax, nil)
	t := time.NewTimer(0)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-c.a.leaveReq.Done():
			return
		case <-c.box.ready:
			for _, o := range c.box.take() {
				c.apply(o) // logged, not used
			}
		case <-c.changed:
			c.wakeStandbys()
		case <-t.C:
			next := c.a.serverRefresh
			if c.refreshAddresses(ctx) || len(c.addrs) > 0 {
				bo.Reset()
			} else {
				next = min(next, bo.Next())
			}
			t.Reset(next)
		}
	}
}

// refreshAddresses resolves the server's name and reconciles the links
// with its addresses; false when the resolve failed (logged once per
// distinct error).
func (c *cluster) refreshAddresses(ctx context.Context) bool {
	_, hostport := c.a.cfg.ServerAddr()
	host, port, err := net.SplitHostPort(hostport)
	if err != nil { // Validate checked it
		return false
	}
	addrs, err := c.resolveAddrs(ctx, host, port)
	if err != nil {
		if ctx.Err() != nil {
			return false
		}
		if msg := err.Error(); msg != c.resolveE {
			c.resolveE = msg
			c.a.log.Warn("cannot resolve the server's name; keeping the sessions with the addresses resolved before",
				zap.String("server", c.a.cfg.Server), zap.Strings("addresses", c.addrs), zap.Error(err))
		}
		c.mu.Lock()
		c.noLink = fmt.Sprintf("no address of %s resolved yet: %v", host, err)
		c.mu.Unlock()
		return false
	}
	c.resolveE = ""
	if !slices.Equal(addrs, c.addrs) {
		c.a.log.Info("server addresses", zap.String("server", c.a.cfg.Server), zap.Strings("addresses", addrs))
	}
	c.addrs = addrs
	c.reconcileAddresses(addrs)
	return true
}

// resolveAddrs resolves host and returns its addresses with port, sorted,
// at most maxLinks of them (the lowest; a warning says so once).
func (c *cluster) resolveAddrs(ctx context.Context, host, port string) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, min(resolveTimeout, c.a.serverRefresh))
	defer cancel()
	ips, err := c.a.resolve(ctx, "ip", host)
	if err != nil {
		return nil, fmt.Errorf("resolving %s: %w", host, err)
	}
	ips = slices.Clone(ips)
	for i, ip := range ips {
		ips[i] = ip.Unmap().WithZone("")
	}
	slices.SortFunc(ips, netip.Addr.Compare)
	ips = slices.Compact(ips)
	if len(ips) == 0 {
		return nil, fmt.Errorf("%s resolves to no address", host)
	}
	if len(ips) > maxLinks {
		c.warnOnce(fmt.Sprintf("the server's name resolves to more than %d addresses; the agent keeps sessions with the first %d", maxLinks, maxLinks),
			zap.Int("addresses", len(ips)))
		ips = ips[:maxLinks]
	}
	out := make([]string, len(ips))
	for i, ip := range ips {
		out[i] = net.JoinHostPort(ip.String(), port)
	}
	return out, nil
}

// reconcileAddresses opens a link for each address without one and
// leaves the links of the addresses gone.
func (c *cluster) reconcileAddresses(addrs []string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.noLink = ""
	for _, addr := range addrs {
		if c.keyedLocked(addr) == nil {
			c.openLocked(addressTarget(c.a.cfg, addr), originAddress, addr)
		}
	}
	for _, e := range slices.Clone(c.entries) {
		if !e.l.leaving() && !slices.Contains(addrs, e.key) {
			c.retireLocked(e, "the server's name no longer resolves to this address")
		}
	}
}

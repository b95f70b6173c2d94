package caddymodule

import (
	"context"
	"errors"
	"net"
	"net/netip"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// addrLimiter counts what each client address holds (requests in flight,
// relayed connections, sessions) against a per-address maximum.
type addrLimiter struct {
	mu sync.Mutex
	by map[string]int
}

func newAddrLimiter() *addrLimiter { return &addrLimiter{by: map[string]int{}} }

// acquire takes one for addr's host unless limit (> 0) is reached. A peer
// without an IP address (a unix socket's, which all share one name) is
// counted but never limited: the address names no one.
func (l *addrLimiter) acquire(addr string, limit int) (release func(), ok bool) {
	host := addrHost(addr)
	if _, err := netip.ParseAddr(host); err != nil {
		limit = 0
	}
	return l.acquireKey(host, limit)
}

// acquireKey takes one for key unless limit (> 0) is reached.
func (l *addrLimiter) acquireKey(host string, limit int) (release func(), ok bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	if limit > 0 && l.by[host] >= limit {
		return nil, false
	}
	l.by[host]++
	var once sync.Once
	return func() {
		once.Do(func() {
			l.mu.Lock()
			if l.by[host]--; l.by[host] <= 0 {
				delete(l.by, host)
			}
			l.mu.Unlock()
		})
	}, true
}

func addrHost(addr string) string {
	if h, _, err := net.SplitHostPort(addr); err == nil {
		return h
	}
	return addr
}

// counterLimiter counts something node-wide against a maximum.
type counterLimiter struct {
	mu sync.Mutex
	n  int
}

func (c *counterLimiter) acquire(limit int) (release func(), ok bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if limit > 0 && c.n >= limit {
		return nil, false
	}
	c.n++
	var once sync.Once
	return func() {
		once.Do(func() {
			c.mu.Lock()
			c.n--
			c.mu.Unlock()
		})
	}, true
}

func (c *counterLimiter) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.n
}

// refuseTCP closes a TCP connection refused by a limit, counting and
// logging it through the throttle.
func (n *node) refuseTCP(client net.Conn, limit string) {
	// Count first: whoever sees the close also sees the count.
	n.logLimit("tcp", limit, client.RemoteAddr().String())
	client.Close()
}

// logLimit counts a refusal and logs it through the throttle.
func (n *node) logLimit(kind, limit, remote string) {
	n.refused.Add(1)
	n.metrics.refuseLimit(limit)
	if ok, suppressed := n.limitLog.Allow(); ok {
		n.log().Warn("connection refused by a limit", zap.String("kind", kind), zap.String("limit", limit),
			zap.String("remote", remote), zap.Int64("refused_total", n.refused.Load()), zap.Int("suppressed_since_last", suppressed))
	}
}

// NodeStats is a snapshot of one node (control address) for operators and
// tests: what its sessions hold and what its limits allow.
type NodeStats struct {
	Listen         string
	Sessions       int
	Connections    int
	Buffered       int64 // received from agents, not yet written to clients
	Queued         int64 // queued towards agents
	BudgetInUse    int64
	BudgetLimit    int64
	SlotsInUse     int64
	MaxConnections int64
	Refused        int64 // requests and connections refused by a limit
	AwaitingAgent  int64 // requests waiting (lb_try_duration) for an agent to serve their host
	PendingStreams int   // authenticated agent streams that have not advertised yet
	PendingConns   int   // control connections that have not authenticated yet
	AuthFailures   int64 // streams refused for a wrong or missing token
	// Of the virtual connections the node opened that ended (HTTP and TCP): how many, how
	// many did not close cleanly, and the bytes they carried each way.
	ConnectionsEnded  int64
	ConnectionsFailed int64
	BytesToClients    int64
	BytesFromClients  int64
	Draining          bool
}

// Stats returns a snapshot of every node of this process.
func Stats() []NodeStats {
	var out []NodeStats
	nodePool.Range(func(_, v any) bool {
		n := v.(*node)
		c := n.metrics.totals()
		st := NodeStats{
			Listen:         n.addr,
			BudgetInUse:    n.budget.InUse(),
			BudgetLimit:    n.budget.Limit(),
			SlotsInUse:     n.slots.InUse(),
			MaxConnections: n.slots.Limit(),
			Refused:        n.refused.Load(),
			AwaitingAgent:  n.awaitingAgent.Load(),
			PendingStreams: n.pending.count(),
			PendingConns:   n.guard.pendingCount(),
			AuthFailures:   n.authFailures.Load(),

			ConnectionsEnded:  c.ended,
			ConnectionsFailed: c.failed,
			BytesToClients:    c.toClients,
			BytesFromClients:  c.fromClients,
			Draining:          n.draining.Load(),
		}
		for _, a := range n.reg.sessions() {
			s := a.sess.Stats()
			st.Sessions++
			st.Connections += s.Conns
			st.Buffered += s.Buffered
			st.Queued += s.Queued
		}
		out = append(out, st)
		return true
	})
	return out
}

// slotReclaimWait bounds how long an Open that found every connection slot
// taken waits for a slot of a closing connection to come back.
const slotReclaimWait = 250 * time.Millisecond

// open opens a virtual connection on sess. When every connection slot is
// taken it does not refuse at once: idle pooled HTTP connections hold slots
// they would keep until the transport's idle timeout, so it closes them,
// and while any connection is closing (those, or others ending) it waits up
// to slotReclaimWait for a slot to come back and tries again
// (tunnelcore.Slots.WaitFree). A slot the node is about to get back is no
// reason to refuse a client. With nothing closing, or as many callers
// already waiting as slots coming back, it returns tunnelcore.ErrConnLimit
// at once; otherwise a refusal comes at most slotReclaimWait later.
//
// A session whose agent is leaving takes connections until the node ends
// it (endWhenIdle); after that starts, open fails with errAgentLeft.
func (n *node) open(ctx context.Context, a *agentSession, info tunnelcore.ConnectInfo) (*tunnelcore.Conn, error) {
	if !a.startOpen() {
		return nil, errAgentLeft
	}
	defer a.opening.Add(-1)
	sess := a.sess
	c, err := sess.Open(info)
	if !errors.Is(err, tunnelcore.ErrConnLimit) {
		return c, err
	}
	n.closeIdleConns()
	deadline := time.Now().Add(slotReclaimWait)
	for time.Now().Before(deadline) && n.slots.WaitFree(ctx, time.Until(deadline)) {
		c, err = sess.Open(info)
		if !errors.Is(err, tunnelcore.ErrConnLimit) {
			return c, err
		}
	}
	return nil, err
}

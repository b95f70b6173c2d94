package caddymodule

import (
	"bufio"
	"go.uber.org/zap"
	"math"
	"net"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
	"sync"
	"time"
)

// connectionCost is the worst-case memory one virtual connection holds
// outside the budget: a 64 KiB receive window, what it queues in front of
// the sender, and the relay's copy buffers (the reference's 293 KiB).
const connectionCost = 293 << 10

// memoryLimit is what the process may use: GOMEMLIMIT when set, else the
// cgroup limit, else physical memory.
func memoryLimit() int64 {
	if l := debug.SetMemoryLimit(-1); l > 0 && l != math.MaxInt64 {
		return l
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory.max"); err == nil {
		if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && v > 0 {
			return v
		}
	}
	if f, err := os.Open("/proc/meminfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) >= 2 && fields[0] == "MemTotal:" {
				if kb, err := strconv.ParseInt(fields[1], 10, 64); err == nil {
					return kb << 10
				}
			}
		}
	}
	return 4 << 30
}

// derivedLimits are the defaults the reference derives from memory: half of
// it for the data plane, an eighth of that half for the tunnel budget, the
// rest for connections at connectionCost each.
type derivedLimits struct {
	memory         int64
	budget         int64
	connMemory     int64
	maxConnections int64
}

func deriveLimits(memory, budget, connMemory, maxConns int64) derivedLimits {
	d := derivedLimits{memory: memory, budget: budget, connMemory: connMemory, maxConnections: maxConns}
	half := memory / 2
	if d.budget <= 0 {
		d.budget = half / 8
	}
	if d.connMemory <= 0 {
		d.connMemory = max(half-d.budget, connectionCost)
	}
	if d.maxConnections <= 0 {
		d.maxConnections = max(d.connMemory/connectionCost, 1)
	}
	return d
}

// addrLimiter counts what each client address holds (requests in flight,
// relayed connections, sessions) against a per-address maximum.
type addrLimiter struct {
	mu sync.Mutex
	by map[string]int
}

func newAddrLimiter() *addrLimiter { return &addrLimiter{by: map[string]int{}} }

// acquire takes one for addr's host unless limit (> 0) is reached.
func (l *addrLimiter) acquire(addr string, limit int) (release func(), ok bool) {
	host := addrHost(addr)
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

func (l *addrLimiter) count(addr string) int {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.by[addrHost(addr)]
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

// logThrottle allows at most burst lines per period and reports how many it
// suppressed since the last line it allowed.
type logThrottle struct {
	period time.Duration
	burst  int

	mu         sync.Mutex
	start      time.Time
	lines      int
	suppressed int
}

func newLogThrottle(period time.Duration, burst int) *logThrottle {
	return &logThrottle{period: period, burst: burst}
}

func (t *logThrottle) allow() (bool, int) {
	t.mu.Lock()
	defer t.mu.Unlock()
	now := time.Now()
	if now.Sub(t.start) >= t.period {
		t.start, t.lines = now, 0
	}
	if t.lines >= t.burst {
		t.suppressed++
		return false, 0
	}
	t.lines++
	n := t.suppressed
	t.suppressed = 0
	return true, n
}

// refuseTCP closes a TCP connection refused by a limit, counting and
// logging it through the throttle.
func (n *node) refuseTCP(client net.Conn, limit string) {
	client.Close()
	n.logLimit("tcp", limit, client.RemoteAddr().String())
}

// logLimit counts a refusal and logs it through the throttle.
func (n *node) logLimit(kind, limit, remote string) {
	n.refused.Add(1)
	if ok, suppressed := n.limitLog.allow(); ok {
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
	Draining       bool
}

// Stats returns a snapshot of every node of this process.
func Stats() []NodeStats {
	var out []NodeStats
	nodePool.Range(func(_, v any) bool {
		n := v.(*node)
		st := NodeStats{
			Listen:         n.addr,
			BudgetInUse:    n.budget.InUse(),
			BudgetLimit:    n.budget.Limit(),
			SlotsInUse:     n.slots.InUse(),
			MaxConnections: n.slots.Limit(),
			Refused:        n.refused.Load(),
			Draining:       n.draining.Load(),
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

package caddymodule

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// portRange is a set of ports agents may claim: one or more inclusive
// spans, kept sorted and merged in their canonical text ("16000-16099,17000"),
// so that == tells whether a reload changed it. lo and hi bound the set; lo
// 0 is the unset set, which contains no port. A portRange with lo and hi but
// no spans is the single span lo-hi.
type portRange struct {
	lo, hi uint32
	spans  string // canonical: sorted, merged, comma-separated "lo-hi" or "port"
}

// contains reports whether port p is in the set.
func (r portRange) contains(p uint32) bool {
	if r.lo == 0 || p < r.lo || p > r.hi {
		return false
	}
	if r.spans == "" {
		return true
	}
	for rest := r.spans; rest != ""; {
		var piece string
		piece, rest, _ = strings.Cut(rest, ",")
		lo, hi, err := parsePortSpan(piece)
		if err == nil && p >= lo && p <= hi {
			return true
		}
	}
	return false
}

func (r portRange) String() string {
	switch {
	case r.lo == 0:
		return "unset"
	case r.spans == "":
		return fmt.Sprintf("%d-%d", r.lo, r.hi)
	}
	return r.spans
}

// parsePortRange parses a port list: comma-separated single ports and
// lo-hi ranges, as "16000-16099,17000" (the reference's
// sluice.tcp-port-range). Pieces may come in any order; overlapping and
// adjacent ones are merged, since the list only says which ports may be
// claimed. "" is the unset set. The error names the bad piece but no
// option: parsePortList adds it.
func parsePortRange(s string) (portRange, error) {
	if strings.TrimSpace(s) == "" {
		return portRange{}, nil
	}
	var spans [][2]uint32
	for piece := range strings.SplitSeq(s, ",") {
		lo, hi, err := parsePortSpan(piece)
		if err != nil && !strings.Contains(s, ",") {
			return portRange{}, fmt.Errorf("%q is not a port range like 16000-16999, a port, or a list like 16000-16099,17000", s)
		}
		if err != nil {
			return portRange{}, fmt.Errorf("%q: %w", s, err)
		}
		spans = append(spans, [2]uint32{lo, hi})
	}
	slices.SortFunc(spans, func(a, b [2]uint32) int { return cmp.Compare(a[0], b[0]) })
	merged := spans[:1]
	for _, sp := range spans[1:] {
		last := &merged[len(merged)-1]
		if sp[0] <= last[1]+1 {
			last[1] = max(last[1], sp[1])
			continue
		}
		merged = append(merged, sp)
	}
	var b strings.Builder
	for i, sp := range merged {
		if i > 0 {
			b.WriteByte(',')
		}
		b.WriteString(strconv.FormatUint(uint64(sp[0]), 10))
		if sp[1] != sp[0] {
			b.WriteByte('-')
			b.WriteString(strconv.FormatUint(uint64(sp[1]), 10))
		}
	}
	return portRange{lo: merged[0][0], hi: merged[len(merged)-1][1], spans: b.String()}, nil
}

// parsePortList is parsePortRange with the option's name in its error,
// for tcp_port_range and udp_port_range alike.
func parsePortList(option, s string) (portRange, error) {
	r, err := parsePortRange(s)
	if err != nil {
		return r, fmt.Errorf("%s: %w", option, err)
	}
	return r, nil
}

// parsePortSpan parses one piece of a port list: "16000-16099" or "17000"
// (spaces around the numbers allowed).
func parsePortSpan(piece string) (lo, hi uint32, err error) {
	l, h, found := strings.Cut(piece, "-")
	if !found {
		h = l
	}
	pl, err1 := strconv.ParseUint(strings.TrimSpace(l), 10, 16)
	ph, err2 := strconv.ParseUint(strings.TrimSpace(h), 10, 16)
	if err1 != nil || err2 != nil || pl == 0 || ph < pl {
		return 0, 0, fmt.Errorf("piece %q is not a port (1-65535) or a range like 16000-16999", strings.TrimSpace(piece))
	}
	return uint32(pl), uint32(ph), nil
}

// portClaim is one port the node listens on for listen-port routes. The
// claimant first in routing order (smallest agent id, then credential
// name: compareAgents) owns it; the others stand by and take over when it
// leaves.
type portClaim struct {
	port      uint32
	ln        net.Listener  // a TCP port's
	udp       *udpPort      // a UDP port's (udpports.go)
	claimants []*routeEntry // in claim order; entries are bound (registry.bind) before they claim
}

// addr is the address the port is bound on.
func (c *portClaim) addr() net.Addr {
	if c.udp != nil {
		return c.udp.sock.LocalAddr()
	}
	return c.ln.Addr()
}

// close closes the port: a TCP port's listener, or a UDP port's socket
// (the flows of its clients end with it).
func (c *portClaim) close() {
	if c.udp != nil {
		c.udp.close()
		return
	}
	c.ln.Close()
}

func (c *portClaim) owner() *routeEntry {
	var best *routeEntry
	// Among the same agent id (a reconnect before the old session ended)
	// the newest claim wins, as it does for HTTP routes.
	for _, e := range c.claimants {
		if best == nil || compareAgents(e.agent, best.agent) <= 0 {
			best = e
		}
	}
	return best
}

// claimedBy reports whether session a has a claim on the port.
func (c *portClaim) claimedBy(a *agentSession) bool {
	for _, e := range c.claimants {
		if e.agent == a {
			return true
		}
	}
	return false
}

// portManager binds the ports agents claim within tcp_port_range (or,
// for the UDP one, udp_port_range) and releases each when its last
// claimant's session ends.
type portManager struct {
	n   *node
	udp bool // binds UDP ports for udp:// listen-port routes
	mu  sync.Mutex
	by  map[uint32]*portClaim
}

func newPortManager(n *node) *portManager {
	return &portManager{n: n, by: map[uint32]*portClaim{}}
}

// rangeOf returns the range of ports the manager binds in, its option's
// name and the host it binds them on.
func (m *portManager) rangeOf(opts *nodeOptions) (r portRange, name, bind string) {
	if m.udp {
		return opts.udp.portRange, "udp_port_range", opts.udp.bind
	}
	return opts.portRange, "tcp_port_range", opts.tcpBind
}

// errNotBound marks listen-port routes the node accepts without binding:
// with no tcp_port_range, a layer4 server of the config serves the port.
var errNotBound = errors.New("not bound by the node")

// claim binds e's port, or joins the claimants of a bound port. It returns
// the reason a claim is refused.
func (m *portManager) claim(e *routeEntry, opts *nodeOptions) error {
	port := e.route.GetListenPort()
	rng, rangeName, bind := m.rangeOf(opts)
	if rng.lo == 0 {
		return errNotBound
	}
	if !rng.contains(port) {
		return fmt.Errorf("port %d is outside %s %s", port, rangeName, rng)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.n.draining.Load() {
		// The drain closes every port (closeAll, under m.mu, after
		// draining is set): a repeated Advertise must not bind one
		// again. Checked under m.mu, so a claim either sees the flag or
		// is among the ports closeAll closes.
		return fmt.Errorf("port %d: the node is shutting down", port)
	}
	if c := m.by[port]; c != nil {
		// A session re-admitting its routes (a repeated Advertise, a
		// reload of the port options) keeps its place among the
		// claimants: a standby stays one, to take over when the owner
		// leaves.
		if o := c.owner(); o != nil && compareAgents(o.agent, e.agent) < 0 && !c.claimedBy(e.agent) {
			return errors.New(tunnelpb.PortHeldReason(port, o.agent.agentID))
		}
		c.claimants = append(c.claimants, e)
		return nil
	}
	c := &portClaim{port: port, claimants: []*routeEntry{e}}
	if err := m.bind(c, bind); err != nil {
		return fmt.Errorf("port %d: %w", port, err)
	}
	m.by[port] = c
	// Throttled: one Advertise may claim up to 1024 ports, and an agent may
	// re-advertise every second.
	if ok, suppressed := m.n.portBindLog.Allow(); ok {
		m.n.log().Info("listening for agent port route", zap.Uint32("port", port), zap.String("agent", e.agent.agentID),
			zap.String("address", c.addr().String()), zap.Bool("udp", m.udp), zap.Int("suppressed_since_last", suppressed))
	}
	return nil
}

// bind binds c's port on host and starts serving it.
func (m *portManager) bind(c *portClaim, host string) error {
	addr := net.JoinHostPort(host, strconv.Itoa(int(c.port)))
	if m.udp {
		p, err := m.n.listenUDPPort(addr, func() *routeEntry { return m.owner(c.port) })
		if err != nil {
			return err
		}
		c.udp = p
		go p.serve()
		return nil
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return err
	}
	c.ln = ln
	go m.serve(c)
	return nil
}

// release drops e's claim; the last claimant's release closes the port.
func (m *portManager) release(e *routeEntry) {
	port := e.route.GetListenPort()
	m.mu.Lock()
	c := m.by[port]
	if c == nil {
		m.mu.Unlock()
		return
	}
	for i, x := range c.claimants {
		if x == e {
			c.claimants = append(c.claimants[:i], c.claimants[i+1:]...)
			break
		}
	}
	closeIt := len(c.claimants) == 0
	if closeIt {
		delete(m.by, port)
	}
	m.mu.Unlock()
	if closeIt {
		c.close()
		if ok, suppressed := m.n.portBindLog.Allow(); ok {
			m.n.log().Info("released agent port route", zap.Uint32("port", port), zap.Int("suppressed_since_last", suppressed))
		}
	}
}

// owner returns the route that owns port, or nil when the node has not
// bound it.
func (m *portManager) owner(port uint32) *routeEntry {
	m.mu.Lock()
	defer m.mu.Unlock()
	if c := m.by[port]; c != nil {
		return c.owner()
	}
	return nil
}

// serve relays every connection to the port's current owner, until the
// listener is closed (release or shutdown). Any other Accept error (out of
// file descriptors, say) is waited out with a backoff, as net/http's server
// does: returning would leave the port bound, the kernel completing
// handshakes nobody accepts, and the route reported as served.
func (m *portManager) serve(c *portClaim) {
	var delay time.Duration
	for {
		conn, err := c.ln.Accept()
		if errors.Is(err, net.ErrClosed) {
			return
		}
		if err != nil {
			delay = min(max(2*delay, 5*time.Millisecond), time.Second)
			if ok, suppressed := m.n.acceptLog.Allow(); ok {
				m.n.log().Error("accepting on agent port route; retrying", zap.Uint32("port", c.port),
					zap.Error(err), zap.Duration("retry_in", delay), zap.Int("suppressed", suppressed))
			}
			time.Sleep(delay)
			continue
		}
		delay = 0
		e := m.owner(c.port)
		if e == nil {
			conn.Close()
			continue
		}
		go m.n.relayTCPAgain(conn, e, "", func() *routeEntry { return m.owner(c.port) })
	}
}

// closeAll closes every port (node shutdown).
func (m *portManager) closeAll() {
	m.mu.Lock()
	claims := m.by
	m.by = map[uint32]*portClaim{}
	m.mu.Unlock()
	for _, c := range claims {
		c.close()
	}
}

// claimCounts returns the ports bound for claims and the standby claims
// (claimants past each port's owner), for the metrics.
func (m *portManager) claimCounts() (bound, standby int) {
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, c := range m.by {
		bound++
		standby += max(len(c.claimants)-1, 0)
	}
	return bound, standby
}

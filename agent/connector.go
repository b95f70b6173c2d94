package agent

import (
	"context"
	"crypto/tls"
	"encoding/binary"
	"errors"
	"fmt"
	"net"
	"net/netip"
	"strconv"
	"sync"
	"time"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Connector defaults.
const (
	// upstreamDialTimeout bounds the dial (and TLS handshake) to an upstream.
	upstreamDialTimeout = 10 * time.Second
	// dialLogEvery rate-limits dial failure lines, per upstream, and the
	// connection limit's refusals.
	dialLogEvery = 10 * time.Second
)

// connector serves the virtual connections the node opens: it finds the
// upstream by route key, dials it and relays.
type connector struct {
	log         *zap.Logger
	upstreams   map[string]*upstream
	maxConns    int64
	dialTimeout time.Duration
	limitLog    *logthrottle.Throttle // refusals at maxConns
	onEnd       func(ConnReport)      // WithConnEnd; nil: none

	mu     sync.Mutex
	active int64
	wg     sync.WaitGroup
}

// upstream is an Upstream prepared for dialing.
type upstream struct {
	cfg      Upstream
	scheme   string // http, https or tcp
	hostport string
	tls      *tls.Config // https targets
	dialLog  *logthrottle.Throttle
	// local, for a route served in-process (Listen), takes the route's
	// connections instead of a dial: the seam that keeps the dial path
	// below unaware of it.
	local *Listener
}

// newConnector prepares cfg's upstreams; maxConns bounds the connections
// relayed at once (agentLimits).
func newConnector(cfg *Config, maxConns int64, log *zap.Logger) *connector {
	c := &connector{
		log:         log,
		upstreams:   make(map[string]*upstream, len(cfg.Upstreams)),
		maxConns:    maxConns,
		dialTimeout: upstreamDialTimeout,
		limitLog:    logthrottle.New(dialLogEvery, 1),
	}
	for _, u := range cfg.Upstreams {
		scheme, hostport := u.TargetURL()
		up := &upstream{cfg: u, scheme: scheme, hostport: hostport, dialLog: logthrottle.New(dialLogEvery, 1), local: u.local}
		if scheme == "https" {
			up.tls = &tls.Config{
				ServerName:         upstreamServerName(u.RewriteHost, hostport),
				InsecureSkipVerify: u.InsecureSkipVerify,
				// The node chose the HTTP version before this handshake;
				// routes to https targets are advertised force_http1.
				NextProtos: []string{"http/1.1"},
				MinVersion: tls.VersionTLS12,
			}
		}
		c.upstreams[u.Name] = up
	}
	return c
}

// upstreamServerName is the TLS server name for an https target: the
// rewrite host when set, else the target's host, without port.
func upstreamServerName(rewriteHost, hostport string) string {
	h := rewriteHost
	if h == "" {
		h = hostport
	}
	if host, _, err := net.SplitHostPort(h); err == nil {
		return host
	}
	return h
}

// serve takes ownership of conn: it refuses it or relays it in a goroutine
// of its own. ctx bounds the dial. Every connection ends in one report
// (finish).
func (c *connector) serve(ctx context.Context, conn *tunnelcore.Conn) {
	info := conn.Info()
	rep := ConnReport{ID: conn.ID(), Route: info.RouteKey, ClientAddr: info.RemoteAddr, OpenedAt: time.Now()}
	up := c.upstreams[rep.Route]
	if up == nil {
		c.log.Debug("connection for an unknown route refused", zap.String("route", rep.Route), zap.Uint64("conn_id", conn.ID()))
		c.refuse(conn, &rep, ConnUnknownRoute, tunnelpb.Error_REFUSED, fmt.Sprintf("route %s not served by this agent", rep.Route))
		return
	}
	rep.Target = up.cfg.Target
	if conn.Datagram() != (up.scheme == "udp") {
		// Strict forwarding: a flow goes to a udp:// target only, a
		// connection never to one.
		c.log.Debug("connection of the wrong kind for its route refused", zap.String("route", rep.Route),
			zap.Bool("datagram", conn.Datagram()), zap.String("target", up.cfg.Target))
		c.refuse(conn, &rep, ConnUnknownRoute, tunnelpb.Error_REFUSED, mismatchMessage(rep.Route, conn.Datagram()))
		return
	}
	if !c.acquire() {
		if ok, suppressed := c.limitLog.Allow(); ok {
			c.log.Warn("connection limit reached; connection refused", zap.String("route", rep.Route),
				zap.Int64("max_connections", c.maxConns), zap.Int("suppressed_since_last", suppressed))
		}
		c.refuse(conn, &rep, ConnLimit, tunnelpb.Error_RESOURCE_EXHAUSTED, "agent connection limit reached")
		return
	}
	if up.local != nil {
		c.handOver(conn, up, &rep) // listen.go
		return
	}
	go func() {
		defer c.wg.Done()
		c.handle(ctx, conn, up, &rep)
		c.release()
		c.finish(&rep) // after release: a report's connection is out of Active
	}()
}

// acquire takes a connection slot (and a place in wait's group), unless
// maxConns are taken.
func (c *connector) acquire() bool {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.active >= c.maxConns {
		return false
	}
	c.active++
	c.wg.Add(1)
	return true
}

// release gives back acquire's slot; the caller leaves wait's group.
func (c *connector) release() {
	c.mu.Lock()
	c.active--
	c.mu.Unlock()
}

// refuse answers conn with code and reports it ended so.
func (c *connector) refuse(conn *tunnelcore.Conn, rep *ConnReport, o ConnOutcome, code tunnelpb.Error_Code, msg string) {
	conn.Abort(code, msg)
	rep.Outcome, rep.Err = o, errors.New(msg)
	c.finish(rep)
}

// finish completes rep and hands it to the WithConnEnd hook.
func (c *connector) finish(rep *ConnReport) {
	rep.Duration = time.Since(rep.OpenedAt)
	if c.onEnd != nil {
		c.onEnd(*rep)
	}
}

// Active returns the number of connections being dialed or relayed.
func (c *connector) Active() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return int(c.active)
}

// wait waits up to d for every handler to finish; it reports whether they did.
func (c *connector) wait(d time.Duration) bool {
	done := make(chan struct{})
	go func() {
		c.wg.Wait()
		close(done)
	}()
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-done:
		return true
	case <-t.C:
		return false
	}
}

// dialFailed logs (through the upstream's throttle) and answers a
// connection whose upstream could not be reached.
func (c *connector) dialFailed(conn *tunnelcore.Conn, up *upstream, msg string, err error) {
	if ok, suppressed := up.dialLog.Allow(); ok {
		c.log.Warn(msg, zap.String("route", up.cfg.Name), zap.String("target", up.cfg.Target),
			zap.Error(err), zap.Int("suppressed", suppressed))
	}
	conn.Abort(tunnelpb.Error_DIAL_FAILED, err.Error())
}

// handle dials conn's upstream and relays; rep gets how it ended.
func (c *connector) handle(ctx context.Context, conn *tunnelcore.Conn, up *upstream, rep *ConnReport) {
	if conn.Datagram() {
		c.handleFlow(ctx, conn, up, rep)
		return
	}
	uc, err := c.dial(ctx, up)
	if err != nil {
		rep.Outcome, rep.Err = c.dialError(ctx, conn, up, err)
		return
	}
	if err := c.sendProxyHeader(uc, up, conn.Info()); err != nil {
		uc.Close()
		rep.Outcome, rep.Err = ConnUpstreamFailed, fmt.Errorf("dial %s: PROXY header: %w", up.cfg.Target, err)
		c.dialFailed(conn, up, "upstream PROXY header failed", rep.Err)
		return
	}
	res := tunnelcore.Relay(uc, conn)
	rep.FromClient, rep.ToClient, rep.Err = res.BToA, res.AToB, res.Err
	if res.Err != nil {
		rep.Outcome = ConnReset
	}
	c.log.Debug("connection relayed",
		zap.String("route", up.cfg.Name), zap.Uint64("conn_id", conn.ID()),
		zap.String("remote_addr", rep.ClientAddr),
		zap.Int64("to_upstream", res.BToA), zap.Int64("from_upstream", res.AToB),
		zap.NamedError("relay_error", res.Err))
}

// dialError answers a connection whose upstream dial failed and returns
// the outcome: the session or the agent ending first is not the
// upstream's fault, and is not logged as one.
func (c *connector) dialError(ctx context.Context, conn *tunnelcore.Conn, up *upstream, err error) (ConnOutcome, error) {
	err = fmt.Errorf("dial %s: %w", up.cfg.Target, err)
	if ctx.Err() != nil {
		c.log.Debug("upstream dial abandoned", zap.String("route", up.cfg.Name), zap.Uint64("conn_id", conn.ID()),
			zap.NamedError("cause", context.Cause(ctx)))
		conn.Abort(tunnelpb.Error_DIAL_FAILED, "agent stopped dialing: its session ended")
		return ConnAbandoned, err
	}
	c.dialFailed(conn, up, "upstream dial failed", err)
	if refusedDial(err) {
		return ConnUpstreamRefused, err
	}
	return ConnUpstreamFailed, err
}

// sendProxyHeader writes the PROXY protocol header naming conn's client to
// the upstream, for a route configured with one.
func (c *connector) sendProxyHeader(uc net.Conn, up *upstream, info tunnelcore.ConnectInfo) error {
	var hdr []byte
	switch up.cfg.ProxyProtocol {
	case "":
		return nil
	case "v2":
		hdr = proxyHeaderV2(info.RemoteAddr, info.LocalAddr)
	default:
		hdr = proxyHeaderV1(info.RemoteAddr, info.LocalAddr)
	}
	uc.SetWriteDeadline(time.Now().Add(c.dialTimeout))
	_, err := uc.Write(hdr)
	uc.SetWriteDeadline(time.Time{})
	return err
}

// dial connects to the upstream: plain TCP for tcp:// and http://, TLS for
// https://.
func (c *connector) dial(ctx context.Context, up *upstream) (net.Conn, error) {
	nd := &net.Dialer{Timeout: c.dialTimeout}
	if up.scheme == "https" {
		td := &tls.Dialer{NetDialer: nd, Config: up.tls}
		return td.DialContext(ctx, "tcp", up.hostport)
	}
	return nd.DialContext(ctx, "tcp", up.hostport)
}

// parseAddrPort parses host:port as an IP address and port; ok is false
// for an empty or unparseable address (or a host name).
func parseAddrPort(s string) (netip.AddrPort, bool) {
	if s == "" {
		return netip.AddrPort{}, false
	}
	ap, err := netip.ParseAddrPort(s)
	if err != nil {
		return netip.AddrPort{}, false
	}
	return netip.AddrPortFrom(ap.Addr().Unmap().WithZone(""), ap.Port()), true
}

// proxyAddrs resolves the PROXY header's source and destination. The source
// is required; a missing or unparseable destination becomes the unspecified
// address of the source's family, so the client address is never lost. Mixed
// families are both written as IPv6 (IPv4-mapped).
func proxyAddrs(src, dst string) (s, d netip.AddrPort, v4, ok bool) {
	s, ok = parseAddrPort(src)
	if !ok {
		return s, d, false, false
	}
	d, dok := parseAddrPort(dst)
	if !dok {
		if s.Addr().Is4() {
			d = netip.AddrPortFrom(netip.IPv4Unspecified(), 0)
		} else {
			d = netip.AddrPortFrom(netip.IPv6Unspecified(), 0)
		}
	}
	if s.Addr().Is4() && d.Addr().Is4() {
		return s, d, true, true
	}
	s = netip.AddrPortFrom(netip.AddrFrom16(s.Addr().As16()), s.Port())
	d = netip.AddrPortFrom(netip.AddrFrom16(d.Addr().As16()), d.Port())
	return s, d, false, true
}

// proxyHeaderV1 returns a PROXY protocol v1 (text) header.
func proxyHeaderV1(src, dst string) []byte {
	s, d, v4, ok := proxyAddrs(src, dst)
	if !ok {
		return []byte("PROXY UNKNOWN\r\n")
	}
	fam := "TCP6"
	if v4 {
		fam = "TCP4"
	}
	return []byte("PROXY " + fam + " " + s.Addr().String() + " " + d.Addr().String() + " " +
		strconv.Itoa(int(s.Port())) + " " + strconv.Itoa(int(d.Port())) + "\r\n")
}

// proxyV2Signature starts every PROXY protocol v2 header.
var proxyV2Signature = []byte("\r\n\r\n\x00\r\nQUIT\n")

// proxyHeaderV2 returns a PROXY protocol v2 (binary) header: command PROXY
// over TCP4/TCP6, or LOCAL when the source is unknown.
func proxyHeaderV2(src, dst string) []byte {
	hdr := make([]byte, 0, 16+36)
	hdr = append(hdr, proxyV2Signature...)
	s, d, v4, ok := proxyAddrs(src, dst)
	if !ok {
		// version 2, command LOCAL; family UNSPEC; no addresses
		return append(hdr, 0x20, 0x00, 0x00, 0x00)
	}
	hdr = append(hdr, 0x21) // version 2, command PROXY
	if v4 {
		hdr = append(hdr, 0x11) // AF_INET, STREAM
		hdr = binary.BigEndian.AppendUint16(hdr, 12)
		a, b := s.Addr().As4(), d.Addr().As4()
		hdr = append(hdr, a[:]...)
		hdr = append(hdr, b[:]...)
	} else {
		hdr = append(hdr, 0x21) // AF_INET6, STREAM
		hdr = binary.BigEndian.AppendUint16(hdr, 36)
		a, b := s.Addr().As16(), d.Addr().As16()
		hdr = append(hdr, a[:]...)
		hdr = append(hdr, b[:]...)
	}
	hdr = binary.BigEndian.AppendUint16(hdr, s.Port())
	return binary.BigEndian.AppendUint16(hdr, d.Port())
}

package caddymodule

import (
	"context"
	"crypto/tls"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptrace"
	"net/url"
	"slices"
	"sync"
	"sync/atomic"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/headers"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp/reverseproxy"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

func init() {
	caddy.RegisterModule(Transport{})
}

// Transport is Caddy's HTTP transport with its dialer replaced: every
// connection to an upstream is a virtual connection on the agent session the
// upstream names. The http transport's options apply (versions, h2c,
// keep-alive, timeouts, TLS to the upstream through the agent), except those
// about dialing a socket, which the agent does: HTTP/3, proxy_protocol,
// dial_timeout, resolvers, local_address, dial_fallback_delay,
// keepalive_interval, network_proxy and forward_proxy_url are refused. A
// virtual connection opens at once; the agent dials the upstream (within
// 10 s) and a failure there is a 502.
//
// With tls, the upstream is reached through the agent's tcp:// route and
// the request's Host is kept (the http transport would set the dial
// address, which names an agent session). The TLS server name is
// tls_server_name (placeholders allowed), or else the request's host; a
// host_pattern or catch-all route pools connections per route, not per
// host, so give it a tls_server_name when its hosts need distinct names.
//
// Unlike the http transport, it keeps up to DefaultMaxIdleConnsPerRoute
// (256) idle connections per agent route unless
// keep_alive.max_idle_conns_per_host says otherwise.
//
// Routes whose agent upstream sets force_http1 always get HTTP/1.1, also
// when versions enable h2c or HTTP/2: the upstream behind them speaks
// nothing else.
type Transport struct {
	reverseproxy.HTTPTransport

	app *App
	h1  *http.Transport // HTTP/1.1-only twin for force_http1 routes; nil when versions offer no HTTP/2
}

// CaddyModule returns the Caddy module information.
func (Transport) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "http.reverse_proxy.transport.sluice",
		New: func() caddy.Module { return new(Transport) },
	}
}

// Provision sets up the embedded HTTP transport, then takes over its dialing.
func (t *Transport) Provision(ctx caddy.Context) error {
	if slices.Contains(t.Versions, "3") {
		return errors.New("sluice transport: versions: HTTP/3 cannot run through a tunnel")
	}
	if t.ProxyProtocol != "" {
		return errors.New("sluice transport: proxy_protocol: set proxy_protocol on the agent's upstream instead")
	}
	if err := refuseSocketOptions(&t.HTTPTransport); err != nil {
		return err
	}
	defaultKeepAlive(&t.HTTPTransport)
	if err := t.HTTPTransport.Provision(ctx); err != nil {
		return err
	}
	app, err := sluiceApp(ctx)
	if err != nil {
		return err
	}
	t.app = app
	rt := t.HTTPTransport.Transport
	// The dial address names a session, not a host: never send it to an
	// HTTP proxy from the environment.
	rt.Proxy = nil
	rt.DialContext = t.dial
	rt.DialTLSContext = nil
	if rt.TLSClientConfig != nil && t.TLS != nil {
		rt.DialTLSContext = t.dialTLS(rt)
	}
	if slices.Contains(t.Versions, "2") || slices.Contains(t.Versions, "h2c") {
		t.h1 = http1Only(rt)
		if rt.DialTLSContext != nil {
			t.h1.DialTLSContext = t.dialTLS(t.h1)
		}
	}
	// The node closes idle pooled connections when it needs their slots
	// (max_connections) and when it drains.
	app.node.registerIdleCloser(t, t.closeIdleConnections)
	return nil
}

// refuseSocketOptions fails for http transport options about dialing a
// socket: the agent dials the upstream, so they would be silently ignored.
func refuseSocketOptions(h *reverseproxy.HTTPTransport) error {
	var option, why string
	switch {
	case h.DialTimeout != 0:
		option, why = "dial_timeout", "the agent dials the upstream (within 10 s; a failure there is a 502)"
	case h.Resolver != nil:
		option, why = "resolvers", "the agent resolves the upstream's name with its own host's resolver"
	case h.LocalAddress != "":
		option, why = "local_address", "the agent dials the upstream from its own host"
	case h.FallbackDelay != 0:
		option, why = "dial_fallback_delay", "the agent dials the upstream from its own host"
	case h.ForwardProxyURL != "" || len(h.NetworkProxyRaw) > 0:
		option, why = "network_proxy/forward_proxy_url", "the agent dials the upstream directly"
	case h.KeepAlive != nil && h.KeepAlive.ProbeInterval != 0:
		option, why = "keepalive_interval", "a virtual connection has no TCP socket (the tunnel's gRPC keepalive watches the link)"
	case h.ReadTimeout != 0 || h.WriteTimeout != 0:
		// Caddy applies them in its own dialer, to TCP sockets only.
		option, why = "read_timeout/write_timeout", "a virtual connection has no TCP socket; bound the exchange with the sluice directive's max_request_time and stream_idle_timeout"
	case h.TLS != nil && len(h.TLS.ExceptPorts) > 0:
		option, why = "tls_except_ports", "the dial address names an agent session, not the upstream's port"
	default:
		return nil
	}
	return fmt.Errorf("sluice transport: %s: not applicable, %s", option, why)
}

// dialTLS returns rt's TLS dialer: a virtual connection, then the TLS
// handshake with the upstream through it. The server name is
// tls_server_name with its placeholders replaced, or else the request's
// host: the dial address names an agent session, not the upstream.
func (t *Transport) dialTLS(rt *http.Transport) func(ctx context.Context, network, addr string) (net.Conn, error) {
	return func(ctx context.Context, network, addr string) (net.Conn, error) {
		conn, err := t.dial(ctx, network, addr)
		if err != nil {
			return nil, err
		}
		cfg := rt.TLSClientConfig.Clone()
		repl, _ := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer)
		switch {
		case repl != nil && cfg.ServerName != "":
			cfg.ServerName = repl.ReplaceAll(cfg.ServerName, "")
		case repl != nil:
			cfg.ServerName = repl.ReplaceAll("{http.request.host}", "")
		}
		if caddyhttp.GetVar(ctx, tlsH1OnlyVar) == true {
			cfg.NextProtos = nil // as net/http does for a request that must stay HTTP/1.1
		}
		if rt.TLSHandshakeTimeout > 0 {
			var cancel context.CancelFunc
			ctx, cancel = context.WithTimeout(ctx, rt.TLSHandshakeTimeout)
			defer cancel()
		}
		tc := tls.Client(conn, cfg)
		if err := tc.HandshakeContext(ctx); err != nil {
			_ = tc.Close()
			return nil, fmt.Errorf("sluice: TLS handshake with the upstream (server name %q): %w", cfg.ServerName, err)
		}
		return tc, nil
	}
}

// tlsH1OnlyVar is the request variable reverse_proxy sets for a request
// that must use HTTP/1.1 over TLS (a WebSocket over an HTTP/2 client
// connection); its own TLS dialer honours it the same way.
const tlsH1OnlyVar = "reverse_proxy.tls_h1_only"

// RequestHeaderOps implements reverseproxy.RequestHeaderOpsTransport. The
// http transport sets Host to the dial address when TLS is on, which here
// names an agent session: the client's Host is kept instead (the agent's
// rewrite_host still applies).
func (t *Transport) RequestHeaderOps() *headers.HeaderOps { return nil }

// DefaultMaxIdleConnsPerRoute is the sluice transport's default for
// keep_alive.max_idle_conns_per_host: how many idle upstream connections it
// keeps per agent route (Caddy's http transport keeps 32 per host).
//
// A pooled virtual connection is cheap to keep (a few KiB on each end and an
// idle socket on the agent) and dear to replace: a new one is a Connect
// through the tunnel, a TCP dial by the agent, and a Close of the one it
// replaces, which leaves a TIME_WAIT socket on the agent's host. With 64
// concurrent clients and 32 kept, wrk through sluice opened 1,300-1,650
// upstream connections per 5 s (enough, at higher rates, to run the agent's
// host out of ephemeral ports, caddy#938); with 256 kept, none (the CPU
// saved on one host is small). Idle ones still close after the transport's idle
// timeout (keep_alive.idle_timeout, 2 min), and when the node reaches
// max_connections. Caddy's maintainers weighed raising their own default
// for busy proxies (caddy#7318).
const DefaultMaxIdleConnsPerRoute = 256

// defaultKeepAlive fills in the sluice transport's keep-alive default
// before Caddy fills in its own; what the config sets is kept.
func defaultKeepAlive(h *reverseproxy.HTTPTransport) {
	if h.KeepAlive == nil {
		h.KeepAlive = new(reverseproxy.KeepAlive)
	}
	if h.KeepAlive.MaxIdleConnsPerHost == 0 {
		h.KeepAlive.MaxIdleConnsPerHost = DefaultMaxIdleConnsPerRoute
	}
}

// http1Only returns a copy of rt (same dialer, timeouts and TLS settings)
// that speaks HTTP/1.1 only, in the clear and over TLS.
func http1Only(rt *http.Transport) *http.Transport {
	h1 := rt.Clone()
	h1.Protocols = new(http.Protocols)
	h1.Protocols.SetHTTP1(true)
	h1.ForceAttemptHTTP2 = false
	// A non-nil empty map turns off net/http's HTTP/2 over TLS.
	h1.TLSNextProto = map[string]func(string, *tls.Conn) http.RoundTripper{}
	if h1.TLSClientConfig != nil {
		h1.TLSClientConfig.NextProtos = []string{"http/1.1"}
	}
	return h1
}

func (t *Transport) closeIdleConnections() {
	t.HTTPTransport.Transport.CloseIdleConnections()
	if t.h1 != nil {
		t.h1.CloseIdleConnections()
	}
}

// Cleanup closes idle connections and stops watching sessions.
func (t *Transport) Cleanup() error {
	if t.app != nil {
		t.app.node.unregisterIdleCloser(t)
	}
	if t.h1 != nil {
		t.h1.CloseIdleConnections()
	}
	return t.HTTPTransport.Cleanup()
}

// RoundTrip rewrites the Host for routes that ask for it, then proxies,
// over HTTP/1.1 for force_http1 routes. It counts the requests in flight on
// each agent session, for an agent that leaves (node.leave), and names the
// agent, route and transport that served in the request's placeholders
// (setServedBy), for Caddy's access log.
func (t *Transport) RoundTrip(req *http.Request) (*http.Response, error) {
	di, ok := reverseproxy.GetDialInfo(req.Context())
	if !ok {
		return t.HTTPTransport.RoundTrip(req)
	}
	e := t.app.node.reg.table.Load().byDialAddress(di.Address)
	if e == nil {
		return t.HTTPTransport.RoundTrip(req)
	}
	setServedBy(req, e)
	var conn atomic.Pointer[net.Conn] // the connection of an upgrade request
	if req.Header.Get("Upgrade") != "" {
		req = req.WithContext(httptrace.WithClientTrace(req.Context(), &httptrace.ClientTrace{
			GotConn: func(info httptrace.GotConnInfo) { conn.Store(&info.Conn) },
		}))
	}
	if h := e.route.GetRewriteHost(); h != "" {
		req.Host = h
	}
	if e.route.GetProxyProtocol() {
		req = perClient(req)
	}
	rt := http.RoundTripper(&t.HTTPTransport)
	if e.route.GetForceHttp1() && t.h1 != nil {
		t.SetScheme(req)
		rt = t.h1
	}
	// Counted, and under the sweep's read lock until it has its
	// connection and the response head: a sweep of a leaving agent's idle
	// connections (closeIdleHTTP) cannot close the one it picks meanwhile.
	e.agent.sweepMu.RLock()
	e.agent.requests.Add(1)
	res, err := rt.RoundTrip(req)
	e.agent.sweepMu.RUnlock()
	if err != nil && errors.Is(e.agent.sess.Err(), errNodeShutDown) {
		// net/http does not pass on why the connection ended: say it,
		// for the answer (serveWithPolicy).
		err = fmt.Errorf("%w (%w)", err, errNodeShutDown)
	}
	if err != nil && refusedAtAgentLimit(err) {
		t.agentLimited(req)
	}
	if err != nil {
		err = cutByRequest(req.Context(), err)
	}
	if err != nil || res.StatusCode == http.StatusSwitchingProtocols {
		// An upgraded connection is never pooled, and not idle when no
		// request is in flight; its body must stay the connection
		// (reverse_proxy asserts io.ReadWriteCloser).
		if err == nil {
			markUpgraded(conn.Load())
		}
		t.requestDone(e.agent)
		return res, err
	}
	res.Body = &countedBody{ReadCloser: res.Body, done: func() { t.requestDone(e.agent) }}
	return res, nil
}

// refusedAtAgentLimit reports whether err is the agent refusing the
// request's connection at its max_connections, before dialing its
// upstream.
func refusedAtAgentLimit(err error) bool {
	var pe *tunnelcore.PeerError
	return errors.As(err, &pe) && pe.Code == tunnelpb.Error_RESOURCE_EXHAUSTED
}

// agentLimited handles a request whose connection the agent refused at its
// max_connections. The node's idle pooled connections count against that
// limit, and they hold it until the transports' idle timeout (each route's
// pool is its own, and the agent's other routes and TCP relays share the
// limit), so they are closed now for the next attempt to find room; the
// request, which the upstream never saw, is answered 503 with Retry-After
// (serveWithPolicy).
func (t *Transport) agentLimited(req *http.Request) {
	t.app.node.logLimit("http", agentConnLimit.String(), clientRemote(req))
	t.app.node.closeIdleConns()
	markLimited(req.Context(), agentConnLimit)
}

// markLimited records on the request's exchange the limit that refused it.
func markLimited(ctx context.Context, limit connLimit) {
	if x, ok := ctx.Value(exchangeKey{}).(*exchange); ok {
		x.limitedBy.Store(uint32(limit))
	}
}

// cutByRequest makes the error of a round trip whose request context
// ended a context.Canceled to reverse_proxy. Go's HTTP/1 transport returns
// the context's cause instead, and for this node's own cuts (the exchange
// deadline, the drain grace) that is an error of ours, which
// reverse_proxy would take for the upstream's failure: count it against
// the agent, and try again (each attempt failing at once on the ended
// context) until lb_try_duration ran out. As context.Canceled it stops at
// once, and serveWithPolicy answers (504, 503).
func cutByRequest(ctx context.Context, err error) error {
	if ctx.Err() == nil || errors.Is(err, context.Canceled) {
		return err
	}
	return fmt.Errorf("%w (%w)", err, context.Canceled)
}

// requestDone ends a request of a; after the last one of a leaving agent,
// its pooled HTTP connections are all idle and closed.
func (t *Transport) requestDone(a *agentSession) {
	if a.requests.Add(-1) == 0 && a.leaving.Load() {
		go a.closeIdleHTTP()
	}
}

// httpConn tags the virtual connections the sluice transport dials
// (tunnelcore.ConnectInfo.Tag), so that those of a leaving agent can be
// closed once idle (agentSession.closeIdleHTTP).
type httpConn struct {
	upgraded atomic.Bool // a 101 made it a WebSocket (or other) tunnel
}

// markUpgraded tags the connection a 101 response came on as upgraded.
func markUpgraded(c *net.Conn) {
	if c == nil {
		return
	}
	if tc := tunnelConn(*c); tc != nil {
		if h, ok := tc.Info().Tag.(*httpConn); ok {
			h.upgraded.Store(true)
		}
	}
}

// countedBody runs done once, after its Close.
type countedBody struct {
	io.ReadCloser
	once sync.Once
	done func()
}

func (b *countedBody) Close() error {
	err := b.ReadCloser.Close()
	b.once.Do(b.done)
	return err
}

// dial opens a virtual connection to the route the dial address names.
// A session that is gone is a retryable 503 (the next agent may serve).
func (t *Transport) dial(ctx context.Context, network, addr string) (net.Conn, error) {
	target := addr
	if di, ok := reverseproxy.GetDialInfo(ctx); ok {
		target = di.Address
	}
	e := t.app.node.reg.table.Load().byDialAddress(target)
	if e == nil {
		return nil, unavailable(fmt.Errorf("sluice: no agent session for %s (agent disconnected)", target))
	}
	info := tunnelcore.ConnectInfo{RouteKey: routeName(e.route), Tag: new(httpConn)}
	if r, ok := ctx.Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		info.RemoteAddr = r.RemoteAddr
	}
	// The address the client reached, for a PROXY header's destination.
	if la, ok := ctx.Value(http.LocalAddrContextKey).(net.Addr); ok {
		info.LocalAddr = la.String()
	}
	// The original request Caddy keeps has no TLS state; its replacer
	// reads the live request's.
	if repl, ok := ctx.Value(caddy.ReplacerCtxKey).(*caddy.Replacer); ok {
		if sn, ok := repl.GetString("http.request.tls.server_name"); ok {
			info.ServerName = sn
		}
	}
	conn, err := t.app.node.open(ctx, e.agent, info)
	if errors.Is(err, tunnelcore.ErrConnLimit) {
		t.app.node.logLimit("http", nodeConnLimit.String(), info.RemoteAddr)
		markLimited(ctx, nodeConnLimit)
	}
	if err != nil {
		return nil, unavailable(fmt.Errorf("sluice: agent %s: %w", e.agent.agentID, err))
	}
	return conn, nil
}

// perClient returns req with its URL's host (the pool key of net/http's
// transports) prefixed with the client's address, as Caddy's http
// transport does for proxy_protocol: the agent writes a route's PROXY
// header once per connection, naming the client whose request dialed it,
// so a pooled connection must serve that client alone. The dial reads its
// address from the dial info, not from the key. Escaped, because HTTP/2
// transports parse the key as an address.
func perClient(req *http.Request) *http.Request {
	r2 := *req
	u := *req.URL
	u.Host = url.QueryEscape(clientRemote(req) + "->" + u.Host)
	r2.URL = &u
	return &r2
}

// clientRemote is the address of the client whose request req proxies
// (the original request's, which reverse_proxy keeps).
func clientRemote(req *http.Request) string {
	if r, ok := req.Context().Value(caddyhttp.OriginalRequestCtxKey).(http.Request); ok {
		return r.RemoteAddr
	}
	return req.RemoteAddr
}

// unavailable makes err a retryable 503 for reverse_proxy.
func unavailable(err error) error {
	return caddyhttp.Error(http.StatusServiceUnavailable, reverseproxy.NewDialError(err))
}

// UnmarshalCaddyfile accepts every `transport http` option. Syntax:
//
//	transport sluice {
//	    versions h2c
//	    ... (any option of transport http)
//	}
func (t *Transport) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	return t.HTTPTransport.UnmarshalCaddyfile(d)
}

// Interface guards
var (
	_ caddy.Provisioner     = (*Transport)(nil)
	_ caddy.CleanerUpper    = (*Transport)(nil)
	_ http.RoundTripper     = (*Transport)(nil)
	_ caddyfile.Unmarshaler = (*Transport)(nil)

	_ reverseproxy.RequestHeaderOpsTransport = (*Transport)(nil)
)

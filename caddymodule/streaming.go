package caddymodule

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"go.uber.org/zap"
)

// StreamPolicy decides how long an exchange may last and when a response is
// a stream (server-sent events, long polls): streams get their own
// whole-exchange deadline and an idle bound between response bytes, and are
// logged once when they close. The policy an exchange starts with is the one
// it keeps; a reload affects new exchanges only.
type StreamPolicy struct {
	// StreamResponseContentTypes are the response media types that make
	// an exchange a stream. Default ["text/event-stream"]; an empty list
	// turns response classification off.
	StreamResponseContentTypes *[]string `json:"stream_response_content_types,omitempty"`

	// StreamRequestAcceptTypes are the Accept media types that announce a
	// stream. An Accept match is provisional: the ordinary deadline holds
	// until the response's Content-Type confirms the stream. Default
	// ["text/event-stream"]; an empty list turns it off.
	StreamRequestAcceptTypes *[]string `json:"stream_request_accept_types,omitempty"`

	// StreamPathPrefixes are request path prefixes that are streams: the
	// stream deadline applies from the start.
	StreamPathPrefixes []string `json:"stream_path_prefixes,omitempty"`

	// MaxRequestTime is the whole-exchange deadline of ordinary requests
	// (connecting, upload, waiting for headers, the response). 0: none.
	// It ends when a protocol switch is answered (a WebSocket's 101, the
	// 2xx to an HTTP/2 extended CONNECT): an upgraded connection is
	// long-lived by nature, and StreamMaxRequestTime bounds it instead.
	MaxRequestTime caddy.Duration `json:"max_request_time,omitempty"`

	// StreamMaxRequestTime is the whole-exchange deadline of streams and
	// upgraded connections, counted from the request's start. 0: none.
	StreamMaxRequestTime caddy.Duration `json:"stream_max_request_time,omitempty"`

	// ResponseHeaderTimeout bounds the wait for the response head, so an
	// upstream (or agent) that accepts a request and never answers cannot
	// park the exchange for good: when it passes, the client gets 504
	// Gateway Timeout. Unset: DefaultResponseHeaderTimeout (60 s, as
	// nginx's proxy_read_timeout); 0 turns it off.
	//
	// Like reverse_proxy's transport response_header_timeout it counts
	// the time the upstream side owes an answer, not the client's: it
	// runs from the request's start (connecting to the agent included),
	// stands still while the request body waits for the client's bytes,
	// and starts over whenever the upstream took a piece of the body, so
	// a long upload is not cut while it moves, and a hung upstream that
	// stops reading it is. It ends with the response head (any final
	// status, or the 101 of an upgrade): a stream whose head came is
	// never cut by it, and stream_max_request_time and
	// stream_idle_timeout bound it from then on. Exchanges that are
	// streams from the start (stream_path_prefixes: long polls that may
	// hold their head back) and gRPC calls (Content-Type
	// application/grpc*: a server-streaming call may send its head with
	// its first message, and the call has its own grpc-timeout) are
	// exempt; their bound is stream_max_request_time. An Accept match is provisional, so an
	// event stream asked for by Accept has this long to send its head.
	ResponseHeaderTimeout *caddy.Duration `json:"response_header_timeout,omitempty"`

	// StreamIdleTimeout closes a stream (by path prefix, or confirmed by
	// its response Content-Type) whose upstream sent no byte for this
	// long. 0: none.
	StreamIdleTimeout caddy.Duration `json:"stream_idle_timeout,omitempty"`
}

var defaultStreamTypes = []string{"text/event-stream"}

// DefaultResponseHeaderTimeout is the response_header_timeout of a
// handler that does not set one: as long as nginx's proxy_read_timeout, far
// above any answer an interactive client still waits for.
const DefaultResponseHeaderTimeout = 60 * time.Second

// responseHeaderTimeout is the effective response_header_timeout; 0: off.
func (p *StreamPolicy) responseHeaderTimeout() time.Duration {
	if p.ResponseHeaderTimeout == nil {
		return DefaultResponseHeaderTimeout
	}
	return time.Duration(*p.ResponseHeaderTimeout)
}

// headWaitFor is the response_header_timeout of r, an exchange that is
// not a stream from the start: none for a gRPC call (any application/grpc
// content type, gRPC-Web's included). A server-streaming call may hold its
// head back until its first message, as a long poll does (grpc-go sends
// it with the first message), so the default would cut a quiet watch
// after a minute; a gRPC call carries its own deadline (grpc-timeout),
// and stream_max_request_time still bounds it.
func headWaitFor(r *http.Request, p *StreamPolicy) time.Duration {
	if isGRPC(r) {
		return 0
	}
	return p.responseHeaderTimeout()
}

// isGRPC reports whether r is a gRPC (or gRPC-Web) call, by its
// Content-Type.
func isGRPC(r *http.Request) bool {
	const grpc = "application/grpc"
	ct := r.Header.Get("Content-Type")
	return len(ct) >= len(grpc) && strings.EqualFold(ct[:len(grpc)], grpc)
}

func (p *StreamPolicy) responseTypes() []string {
	if p.StreamResponseContentTypes == nil {
		return defaultStreamTypes
	}
	return *p.StreamResponseContentTypes
}

func (p *StreamPolicy) acceptTypes() []string {
	if p.StreamRequestAcceptTypes == nil {
		return defaultStreamTypes
	}
	return *p.StreamRequestAcceptTypes
}

func (p *StreamPolicy) validate() error {
	for name, d := range map[string]caddy.Duration{
		"max_request_time": p.MaxRequestTime, "stream_max_request_time": p.StreamMaxRequestTime,
		"stream_idle_timeout": p.StreamIdleTimeout, "response_header_timeout": caddy.Duration(p.responseHeaderTimeout()),
	} {
		if d < 0 {
			return fmt.Errorf("sluice: %s must not be negative", name)
		}
	}
	for name, list := range map[string][]string{
		"stream_response_content_types": p.responseTypes(), "stream_request_accept_types": p.acceptTypes(),
	} {
		if err := checkMediaTypes(list); err != nil {
			return fmt.Errorf("sluice: %s: %w", name, err)
		}
	}
	return nil
}

// checkMediaTypes accepts bare media types (type/subtype, no parameters).
func checkMediaTypes(list []string) error {
	for _, t := range list {
		if !strings.Contains(t, "/") || strings.ContainsAny(t, ",; ") {
			return fmt.Errorf("%q is not a media type like text/event-stream (several are separated by spaces; off alone turns the match off)", t)
		}
	}
	return nil
}

// mediaTypeMatches reports whether a header value (a comma-separated list
// of media types with optional parameters) names one of types: compared
// case-insensitively, parameters ignored, whole values only.
func mediaTypeMatches(header string, types []string) bool {
	if header == "" || len(types) == 0 {
		return false
	}
	for _, part := range strings.Split(header, ",") {
		mt, _, _ := strings.Cut(part, ";")
		mt = strings.TrimSpace(mt)
		for _, t := range types {
			if strings.EqualFold(mt, t) {
				return true
			}
		}
	}
	return false
}

// pathPrefixMatches reports whether path starts with a non-empty prefix.
func pathPrefixMatches(path string, prefixes []string) bool {
	for _, p := range prefixes {
		if p != "" && strings.HasPrefix(path, p) {
			return true
		}
	}
	return false
}

// Classification sources and outcomes, as logged.
const (
	classPathPrefix  = "path_prefix"
	classAccept      = "request_accept"
	classContentType = "response_content_type"
	classUpgrade     = "upgrade"

	outcomeCompleted        = "completed"
	outcomeClientDisconnect = "client_disconnect"
	outcomeUpstreamError    = "upstream_error"
	outcomeExchangeTimeout  = "exchange_timeout"
	outcomeIdleTimeout      = "idle_timeout"
	outcomeShutdown         = "shutdown"
)

var (
	errExchangeTimeout = errors.New("sluice: exchange deadline passed")
	errHeaderTimeout   = errors.New("sluice: no response head within response_header_timeout")
	errIdleTimeout     = errors.New("sluice: stream idle timeout")
	errShutdown        = errors.New("sluice: node shutting down")
	errAborted         = errors.New("sluice: response aborted")
)

// exchange is the per-request state of the policy.
type exchange struct {
	policy   *StreamPolicy
	start    time.Time
	cancel   context.CancelCauseFunc
	expected string // classification before the response (path_prefix / request_accept)
	connect  bool   // the request is a CONNECT: a 2xx answer switches protocols

	mu        sync.Mutex
	confirmed string // classification once the response confirmed a stream
	deadline  *time.Timer
	idle      *time.Timer
	shutdown  *time.Timer
	committed bool

	// The response_header_timeout (headWait; 0: none): headTimer runs
	// while the exchange waits on the upstream side for its head, and is
	// paused while bodyReads > 0 (the request body waits for the client).
	headWait  time.Duration
	headTimer *time.Timer
	headDue   time.Time // when the armed head timer is due
	bodyReads int
	headDone  atomic.Bool // the response head came: no more head timing

	bytesOut atomic.Int64
	bytesIn  atomic.Int64

	// limitedBy is the connection limit that refused this exchange's
	// connection (a connLimit), set by the transport; 0 if none did.
	limitedBy atomic.Uint32
}

// connLimit is a connection limit an exchange can be refused by.
type connLimit uint32

const (
	nodeConnLimit  connLimit = iota + 1 // the node's max_connections: no free slot
	agentConnLimit                      // the agent's max_connections
)

func (l connLimit) String() string {
	if l == agentConnLimit {
		return "the agent's max_connections"
	}
	return "max_connections"
}

// exchangeKey carries the *exchange in the request context down to the
// transport's dial (net/http keeps the request's context values for it).
type exchangeKey struct{}

// arm installs the whole-exchange deadline d, counted from the start.
func (x *exchange) armLocked(d time.Duration) {
	if x.deadline != nil {
		x.deadline.Stop()
		x.deadline = nil
	}
	if d <= 0 {
		return
	}
	remaining := time.Until(x.start.Add(d))
	x.deadline = time.AfterFunc(max(remaining, 0), func() { x.cancel(errExchangeTimeout) })
}

// armHeadLocked (re)starts the response_header_timeout from now, unless
// it is off, the head came, or a body read is waiting for the client.
func (x *exchange) armHeadLocked() {
	if x.headWait <= 0 || x.headDone.Load() || x.bodyReads > 0 {
		return
	}
	x.headDue = time.Now().Add(x.headWait)
	if x.headTimer == nil {
		x.headTimer = time.AfterFunc(x.headWait, x.headExpired)
		return
	}
	x.headTimer.Reset(x.headWait)
}

// headExpired ends the exchange with errHeaderTimeout, unless the head
// came, a body read began or the timer was re-armed while it fired (Stop
// and Reset cannot recall a callback already on its way; a re-armed timer
// fires again when due).
func (x *exchange) headExpired() {
	x.mu.Lock()
	late := x.headDone.Load() || x.bodyReads > 0 || time.Now().Before(x.headDue)
	x.mu.Unlock()
	if !late {
		x.cancel(fmt.Errorf("%w (%s)", errHeaderTimeout, x.headWait))
	}
}

// bodyReadStart pauses the response_header_timeout while reverse_proxy
// waits for the client's request body bytes: a slow client is not the
// upstream's fault (Caddy's server read timeouts bound it).
func (x *exchange) bodyReadStart() {
	if x.headWait <= 0 || x.headDone.Load() {
		return
	}
	x.mu.Lock()
	x.bodyReads++
	if x.headTimer != nil {
		x.headTimer.Stop()
	}
	x.mu.Unlock()
}

// bodyReadEnd restarts the response_header_timeout in full: the upstream
// took the body bytes before this read (reverse_proxy reads the next piece
// once the last one is written to the tunnel), so it is alive.
func (x *exchange) bodyReadEnd() {
	if x.headWait <= 0 || x.headDone.Load() {
		return
	}
	x.mu.Lock()
	if x.bodyReads > 0 {
		x.bodyReads--
	}
	x.armHeadLocked()
	x.mu.Unlock()
}

// onResponse classifies the response when its headers are written.
func (x *exchange) onResponse(code int, h http.Header) {
	x.mu.Lock()
	defer x.mu.Unlock()
	x.committed = true
	x.headDone.Store(true)
	if x.headTimer != nil {
		x.headTimer.Stop()
	}
	if code == http.StatusSwitchingProtocols || (x.connect && code/100 == 2) {
		// The bytes of an upgraded connection bypass this writer
		// (reverse_proxy hijacks the client connection), so there is
		// no idle bound to keep here, only the stream deadline.
		x.confirmed = classUpgrade
		x.armLocked(time.Duration(x.policy.StreamMaxRequestTime))
		return
	}
	typed := mediaTypeMatches(h.Get("Content-Type"), x.policy.responseTypes())
	switch {
	case x.expected == classPathPrefix:
		// A stream from the start, whatever its type (NDJSON, say).
		x.confirmed = classPathPrefix
	case !typed:
		return // an Accept-only match with an ordinary response stays ordinary
	default:
		x.confirmed = classContentType
		if x.expected == classAccept {
			x.confirmed = classAccept
		}
		x.armLocked(time.Duration(x.policy.StreamMaxRequestTime))
	}
	if typed {
		// An event stream's length is unknown: never let a
		// Content-Length through.
		h.Del("Content-Length")
	}
	if d := time.Duration(x.policy.StreamIdleTimeout); d > 0 {
		x.idle = time.AfterFunc(d, func() { x.cancel(errIdleTimeout) })
	}
}

// onBytes records response bytes and resets the idle bound.
func (x *exchange) onBytes(n int) {
	x.bytesOut.Add(int64(n))
	x.mu.Lock()
	if x.idle != nil {
		x.idle.Reset(time.Duration(x.policy.StreamIdleTimeout))
	}
	x.mu.Unlock()
}

func (x *exchange) stop() {
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.deadline != nil {
		x.deadline.Stop()
	}
	if x.idle != nil {
		x.idle.Stop()
	}
	if x.shutdown != nil {
		x.shutdown.Stop()
	}
	x.headDone.Store(true) // a late body read must not arm the head timer again
	if x.headTimer != nil {
		x.headTimer.Stop()
	}
}

func (x *exchange) isStream() bool {
	x.mu.Lock()
	defer x.mu.Unlock()
	return x.confirmed != "" || x.expected == classPathPrefix
}

// serveWithPolicy runs next under the stream policy.
func (h *Handler) serveWithPolicy(w http.ResponseWriter, r *http.Request, next func(http.ResponseWriter, *http.Request) error) error {
	p := &h.StreamPolicy
	clientCtx := r.Context()
	ctx, cancel := context.WithCancelCause(clientCtx)
	defer cancel(nil)
	x := &exchange{policy: p, start: time.Now(), cancel: cancel, connect: r.Method == http.MethodConnect}
	switch {
	case pathPrefixMatches(r.URL.Path, p.StreamPathPrefixes):
		// A stream from the start may hold its head back (a long
		// poll): no response_header_timeout.
		x.expected = classPathPrefix
		x.armLocked(time.Duration(p.StreamMaxRequestTime))
	default:
		if mediaTypeMatches(r.Header.Get("Accept"), p.acceptTypes()) {
			x.expected = classAccept
		}
		x.armLocked(time.Duration(p.MaxRequestTime))
		x.headWait = headWaitFor(r, p)
		x.armHeadLocked() // x is not shared yet
	}
	defer x.stop()

	// A node shutting down ends what is still running when its drain
	// grace is over.
	n := h.app.node
	stopWatch := context.AfterFunc(n.drainCtx, func() {
		x.mu.Lock()
		x.shutdown = time.AfterFunc(n.opts.Load().drainGrace, func() { cancel(errShutdown) })
		x.mu.Unlock()
	})
	defer stopWatch()

	if r.Body != nil && r.Body != http.NoBody {
		r.Body = &countingBody{ReadCloser: r.Body, x: x}
	}
	pw := &policyWriter{ResponseWriter: w, x: x, ctx: ctx, clientCtx: clientCtx}
	// reverse_proxy ends a response it cannot finish once the headers are
	// out (a deadline or the idle bound cancelled the upstream read, the
	// client left, the upstream failed) with panic(http.ErrAbortHandler),
	// so next does not return: log the stream on the way out and let the
	// panic go on (net/http then closes the connection or resets the
	// stream, which is what tells the client the stream was cut).
	returned := false
	defer func() {
		if !returned && x.isStream() {
			h.logStream(r, x, outcome(errAborted, context.Cause(ctx), clientCtx, n.drainCtx))
		}
	}()
	err := next(pw, r.WithContext(context.WithValue(ctx, exchangeKey{}, x)))
	returned = true

	cause := context.Cause(ctx)
	x.mu.Lock()
	committed := x.committed
	x.mu.Unlock()
	if limit := connLimit(x.limitedBy.Load()); limit != 0 && !committed {
		// The dial found every connection slot taken, or the agent
		// refused the connection at its limit (the transport counted and
		// logged it): answer 503 with Retry-After.
		answerLimited(w, limit.String())
		return nil
	}
	switch {
	case committed:
	case errors.Is(cause, errExchangeTimeout), errors.Is(cause, errHeaderTimeout):
		err = caddyhttp.Error(http.StatusGatewayTimeout, cause)
	case errors.Is(cause, errShutdown) || errors.Is(err, errNodeShutDown):
		// Cut before its answer by the end of the drain grace (this
		// exchange's timer, or the node ending the tunnel sessions, which
		// race): another node, or this one restarted, may serve it.
		err = caddyhttp.Error(http.StatusServiceUnavailable, errShutdown)
	}
	if x.isStream() {
		h.logStream(r, x, outcome(err, cause, clientCtx, n.drainCtx))
	}
	if committed && cause != nil && !errors.Is(cause, context.Canceled) {
		return nil // the stream was cut on purpose; the outcome is logged
	}
	if !committed && isUnavailable(err) {
		// The node shutting down, the agent's session gone while dialing:
		// the request may succeed elsewhere or soon. Caddy's error
		// handling writes the status and keeps the headers set here.
		w.Header().Set("Retry-After", "1")
	}
	return err
}

// isUnavailable reports whether err answers 503.
func isUnavailable(err error) bool {
	he, ok := errors.AsType[caddyhttp.HandlerError](err)
	return ok && he.StatusCode == http.StatusServiceUnavailable
}

// outcome names how an exchange ended. A failure while the node drains is
// a shutdown even when the drain closed the tunnel connection before the
// exchange's own grace timer fired (the two race at the end of the grace).
func outcome(err, cause error, clientCtx, drainCtx context.Context) string {
	switch {
	case errors.Is(cause, errExchangeTimeout):
		return outcomeExchangeTimeout
	case errors.Is(cause, errIdleTimeout):
		return outcomeIdleTimeout
	case errors.Is(cause, errShutdown):
		return outcomeShutdown
	case clientCtx.Err() != nil:
		return outcomeClientDisconnect
	case err != nil && drainCtx.Err() != nil:
		return outcomeShutdown
	case err != nil:
		return outcomeUpstreamError
	default:
		return outcomeCompleted
	}
}

func (h *Handler) logStream(r *http.Request, x *exchange, out string) {
	x.mu.Lock()
	class := x.confirmed
	if class == "" {
		class = x.expected
	}
	x.mu.Unlock()
	h.app.node.metrics.countStream(class, out)
	h.logger.Info("stream closed",
		zap.String("host", r.Host), zap.String("uri", r.RequestURI), zap.String("remote", r.RemoteAddr),
		zap.String("classification", class), zap.String("outcome", out),
		zap.Duration("duration", time.Since(x.start)),
		zap.Int64("bytes_in", x.bytesIn.Load()), zap.Int64("bytes_out", x.bytesOut.Load()),
		zap.Duration("stream_max_request_time", time.Duration(x.policy.StreamMaxRequestTime)),
		zap.Duration("stream_idle_timeout", time.Duration(x.policy.StreamIdleTimeout)))
}

// countingBody counts request body bytes, and tells the exchange when a
// read waits for the client (see StreamPolicy.ResponseHeaderTimeout).
type countingBody struct {
	io.ReadCloser
	x *exchange
}

func (b *countingBody) Read(p []byte) (int, error) {
	b.x.bodyReadStart()
	n, err := b.ReadCloser.Read(p)
	b.x.bodyReadEnd()
	b.x.bytesIn.Add(int64(n))
	return n, err
}

// policyWriter sees the response head and every body write.
type policyWriter struct {
	http.ResponseWriter
	x              *exchange
	ctx, clientCtx context.Context // the exchange's, and the client's
	wroteHeader    bool
}

// statusClientClosedRequest is what reverse_proxy answers when the round
// trip ends with context.Canceled, taking it for a client that left.
const statusClientClosedRequest = 499

func (w *policyWriter) WriteHeader(code int) {
	if !w.wroteHeader && code == statusClientClosedRequest && w.clientCtx.Err() == nil && context.Cause(w.ctx) != nil {
		// Our own cancel (a deadline, the shutdown), which Go's HTTP/2
		// client reports as context.Canceled rather than its cause (the
		// HTTP/1 transport gives the cause). The client is still there:
		// serveWithPolicy answers it (504, 503).
		return
	}
	if !w.wroteHeader && (code >= 200 || code == http.StatusSwitchingProtocols) {
		w.wroteHeader = true
		w.x.onResponse(code, w.Header())
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *policyWriter) Write(p []byte) (int, error) {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	n, err := w.ResponseWriter.Write(p)
	w.x.onBytes(n)
	return n, err
}

// Unwrap lets http.ResponseController reach Flush, deadlines and Hijack.
func (w *policyWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

// Flush implements http.Flusher (reverse_proxy flushes streams).
func (w *policyWriter) Flush() {
	if !w.wroteHeader {
		w.WriteHeader(http.StatusOK)
	}
	http.NewResponseController(w.ResponseWriter).Flush()
}

// Hijack implements http.Hijacker for WebSocket upgrades. reverse_proxy
// copies an upgraded connection's bytes between the hijacked client
// connection and the upstream itself, past this writer and the request
// body: the connection is returned counting them for the "stream closed"
// line. The bytes the client sent ahead, which reverse_proxy takes from
// the buffered reader, count at once; the 101 head it flushes does not.
func (w *policyWriter) Hijack() (net.Conn, *bufio.ReadWriter, error) {
	c, brw, err := http.NewResponseController(w.ResponseWriter).Hijack()
	if err != nil {
		return c, brw, err
	}
	if brw != nil {
		w.x.bytesIn.Add(int64(brw.Reader.Buffered()))
	}
	return &countingConn{Conn: c, in: &w.x.bytesIn, out: &w.x.bytesOut}, brw, nil
}

// countingConn counts the bytes read from (in) and written to (out) a
// hijacked client connection. It keeps CloseWrite, by which reverse_proxy
// passes on a half-close; ReadFrom and WriteTo of a TCP connection are no
// loss, as they copy through a buffer anyway when the other end is the
// upstream's connection (neither a socket nor a file).
type countingConn struct {
	net.Conn
	in, out *atomic.Int64
}

func (c *countingConn) Read(p []byte) (int, error) {
	n, err := c.Conn.Read(p)
	c.in.Add(int64(n))
	return n, err
}

func (c *countingConn) Write(p []byte) (int, error) {
	n, err := c.Conn.Write(p)
	c.out.Add(int64(n))
	return n, err
}

// errNoCloseWrite: the client connection cannot be half-closed;
// reverse_proxy then ends the whole tunnel, as it does for such a
// connection unwrapped.
var errNoCloseWrite = errors.New("sluice: the client connection cannot be half-closed")

// CloseWrite half-closes the client connection.
func (c *countingConn) CloseWrite() error {
	if cw, ok := c.Conn.(interface{ CloseWrite() error }); ok {
		return cw.CloseWrite()
	}
	return errNoCloseWrite
}

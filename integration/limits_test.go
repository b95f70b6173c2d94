package integration

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"runtime"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/agent"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// limClient sends requests to Caddy with a Host, one client connection
// per request in flight.
func limClient() *http.Client {
	return &http.Client{Timeout: 30 * time.Second, Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}}
}

func limRequest(ctx context.Context, c *caddyServer, method, host, path string, body io.Reader) *http.Request {
	req, _ := http.NewRequestWithContext(ctx, method, c.url(path), body)
	req.Host = host
	return req
}

type limResult struct {
	code int
	body string
	err  error
}

// limFill sends n requests for /hold and waits until all reached the upstream.
func limFill(t *testing.T, c *caddyServer, cl *http.Client, up *limHoldUpstream, host string, n int) chan limResult {
	t.Helper()
	out := make(chan limResult, n)
	for i := 0; i < n; i++ {
		go func() {
			resp, err := cl.Do(limRequest(context.Background(), c, "GET", host, "/hold", nil))
			if err != nil {
				out <- limResult{err: err}
				return
			}
			b, err := io.ReadAll(resp.Body)
			resp.Body.Close()
			out <- limResult{code: resp.StatusCode, body: string(b), err: err}
		}()
	}
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	for i := 0; i < n; i++ {
		select {
		case <-up.arrived:
		case r := <-out:
			t.Fatalf("%d of %d requests held; one ended: status %d, body %q, err %v; stats %+v", i, n, r.code, r.body, r.err, c.mustStats(t))
		case <-timer.C:
			t.Fatalf("only %d of %d requests reached the upstream within 10s; stats %+v", i, n, c.mustStats(t))
		}
	}
	return out
}

func limCollect(t *testing.T, out chan limResult, n int, want int) {
	t.Helper()
	timer := time.NewTimer(10 * time.Second)
	defer timer.Stop()
	for i := 0; i < n; i++ {
		select {
		case r := <-out:
			if r.err != nil || r.code != want {
				t.Fatalf("held request %d: status %d, body %q, err %v; want %d", i, r.code, r.body, r.err, want)
			}
		case <-timer.C:
			t.Fatalf("only %d of %d held requests answered", i, n)
		}
	}
}

// limExpect503 sends one request and expects the limit's 503.
func limExpect503(t *testing.T, c *caddyServer, cl *http.Client, host, limit string) {
	t.Helper()
	resp, err := cl.Do(limRequest(context.Background(), c, "GET", host, "/", nil))
	if err != nil {
		t.Fatal(err)
	}
	b, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != http.StatusServiceUnavailable || resp.Header.Get("Retry-After") == "" ||
		!strings.Contains(string(b), "connection limit") || !strings.Contains(string(b), limit) || len(b) > 512 {
		t.Fatalf("over the limit: status %d, Retry-After %q, body %q; want 503 naming %s", resp.StatusCode, resp.Header.Get("Retry-After"), b, limit)
	}
}

// limitSites proxies hold.test with reverse_proxy's default keep-alive
// pool, and nokeep.test with keep-alive to the agent off.
const limitSites = `http://hold.test:{HTTP} {
	sluice
}

http://nokeep.test:{HTTP} {
	sluice {
		transport sluice {
			keepalive off
		}
	}
}`

// TestMaxConnectionsRefusesAndReleases fills max_connections with held
// requests: the next HTTP request gets 503 + Retry-After, the next TCP
// connection is closed at once, and releasing them gives every slot back,
// for 100 rounds with keep-alive to the agent off and 100 with the default
// pool (whose idle connections keep their slots for reuse).
func TestMaxConnectionsRefusesAndReleases(t *testing.T) {
	const limit = 4
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("\t\tmax_connections %d\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1", limit, port, port)}, limitSites)
	up := startLimHoldUpstream(t)
	echo := limEchoServer(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "hold.test", Target: up.url},
		agent.Upstream{Host: "nokeep.test", Target: up.url},
		agent.Upstream{ListenPort: port, Target: fmt.Sprintf("tcp://127.0.0.1:%d", echo)})
	tcpAddr := fmt.Sprintf("127.0.0.1:%d", port)
	tcpEcho := func() error { return limDialEcho(tcpAddr) }
	eventually(t, 10*time.Second, "the listen port relays", func() bool { return tcpEcho() == nil })
	eventually(t, 5*time.Second, "no slot in use before the rounds", func() bool { return c.mustStats(t).SlotsInUse == 0 })
	if st := c.mustStats(t); st.MaxConnections != limit {
		t.Fatalf("MaxConnections %d, want %d", st.MaxConnections, limit)
	}

	cl := limClient()
	defer cl.CloseIdleConnections()
	const rounds = 100
	var worstTCPClose time.Duration
	run := func(t *testing.T, host string) {
		start := time.Now()
		for round := 0; round < rounds; round++ {
			refusedBefore := c.mustStats(t).Refused
			out := limFill(t, c, cl, up, host, limit)
			if st := c.mustStats(t); st.SlotsInUse != limit {
				t.Fatalf("round %d: %d slots in use with %d requests held", round, st.SlotsInUse, limit)
			}
			limExpect503(t, c, cl, host, "max_connections")

			conn, err := net.DialTimeout("tcp", tcpAddr, 2*time.Second)
			if err != nil {
				t.Fatalf("round %d: dial the listen port: %v", round, err)
			}
			conn.Write([]byte("hello?"))
			took, err := limClosedWithin(conn, 2*time.Second)
			conn.Close()
			if err != nil {
				t.Fatalf("round %d: TCP over the limit: %v", round, err)
			}
			worstTCPClose = max(worstTCPClose, took)

			up.release()
			limCollect(t, out, limit, http.StatusOK)
			// The refusals closed the transport's idle connections (and
			// make it close those that turn idle now): every slot comes back
			// with or without keep-alive.
			eventually(t, 5*time.Second, fmt.Sprintf("round %d: every slot back", round), func() bool {
				return c.mustStats(t).SlotsInUse == 0
			})
			if got := c.mustStats(t).Refused - refusedBefore; got != 2 {
				t.Fatalf("round %d: Refused grew by %d, want 2 (one HTTP request, one TCP connection)", round, got)
			}
		}
		t.Logf("%d rounds in %v; slowest TCP refusal %v; stats %+v", rounds, time.Since(start), worstTCPClose, c.mustStats(t))
	}
	t.Run("keep-alive off", func(t *testing.T) { run(t, "nokeep.test") })
	t.Run("keep-alive pool", func(t *testing.T) { run(t, "hold.test") })

	// Idle pooled connections keep their slots for reuse: a burst filling
	// the limit must not leave the next requests refused while the pool
	// holds every slot (they reuse the idle connections). A connection
	// needing a new slot is not refused either: the node closes the idle
	// ones and takes a slot as soon as one comes back.
	t.Run("idle pool does not starve", func(t *testing.T) {
		refusedBefore := c.mustStats(t).Refused
		burst := func() {
			for round := 0; round < 3; round++ {
				out := limFill(t, c, cl, up, "hold.test", limit)
				up.release()
				limCollect(t, out, limit, http.StatusOK)
			}
			if st := c.mustStats(t); st.SlotsInUse != limit {
				t.Fatalf("after the bursts %d slots in use, want all %d held by idle pooled connections", st.SlotsInUse, limit)
			}
		}
		burst()
		if err := tcpEcho(); err != nil {
			t.Fatalf("TCP with every slot held by idle pooled connections: %v", err)
		}
		// The relay winds down after the echo (the upstream closes its
		// side after the client's); the next burst wants every slot.
		eventually(t, 5*time.Second, "the TCP relay's slot back", func() bool { return c.mustStats(t).SlotsInUse == 0 })
		burst()
		resp, err := cl.Do(limRequest(context.Background(), c, "GET", "nokeep.test", "/", nil))
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("HTTP on another transport with every slot held by idle pooled connections: status %d", resp.StatusCode)
		}
		if got := c.mustStats(t).Refused - refusedBefore; got != 0 {
			t.Fatalf("%d connections refused though idle pooled connections could give their slots back", got)
		}
		// The last dial closed the idle pool; the keep-alive-off connection
		// it served closes after its response.
		eventually(t, 5*time.Second, "every slot back once the idle pool is closed", func() bool {
			st := c.mustStats(t)
			return st.SlotsInUse == 0 && st.Connections == 0
		})
	})
}

// TestMaxConnectionsPerAddress: with two requests of 127.0.0.1 in flight,
// its third request gets 503 + Retry-After and its TCP connection is
// closed; once they end, it is served again.
func TestMaxConnectionsPerAddress(t *testing.T) {
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("\t\tmax_connections_per_address 2\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1", port, port)}, siteAll)
	up := startLimHoldUpstream(t)
	echo := limEchoServer(t)
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "hold.test", Target: up.url},
		agent.Upstream{ListenPort: port, Target: fmt.Sprintf("tcp://127.0.0.1:%d", echo)})
	tcpAddr := fmt.Sprintf("127.0.0.1:%d", port)
	tcpEcho := func() error { return limDialEcho(tcpAddr) }
	// The port is bound before the agent is acknowledged. (No probe here:
	// a probe's relay would count against the address while it winds down.)

	cl := limClient()
	defer cl.CloseIdleConnections()
	refusedBefore := c.mustStats(t).Refused
	out := limFill(t, c, cl, up, "hold.test", 2)
	limExpect503(t, c, cl, "hold.test", "max_connections_per_address")
	conn, err := net.DialTimeout("tcp", tcpAddr, 2*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	took, err := limClosedWithin(conn, 2*time.Second)
	conn.Close()
	if err != nil {
		t.Fatalf("TCP over the per-address limit: %v", err)
	}
	if got := c.mustStats(t).Refused - refusedBefore; got != 2 {
		t.Fatalf("Refused grew by %d, want 2", got)
	}
	t.Logf("TCP over the per-address limit closed after %v", took)

	up.release()
	limCollect(t, out, 2, http.StatusOK)
	// A handler gives its count back just after its response is written.
	eventually(t, 5*time.Second, "served again once the held requests ended", func() bool {
		code, _ := get(t, c, "hold.test", "/")
		return code == 200
	})
	if err := tcpEcho(); err != nil {
		t.Fatalf("TCP after the held requests ended: %v", err)
	}
}

// TestAdvertiseWithAnOversizedIDIsRefused: an agent id is bounded (128
// bytes of printable ASCII), as what an agent puts in the node's log lines
// is: a 256 KiB id is refused with INVALID_ARGUMENT before the session.
func TestAdvertiseWithAnOversizedIDIsRefused(t *testing.T) {
	c := startCaddy(t, siteAll)
	cc := limControlClient(t, c)
	for _, id := range []string{strings.Repeat("x", 256<<10), "spa ce", "nul\x00"} {
		r := limOpenRaw(t, cc)
		if err := r.advertise(id); err != nil {
			t.Fatalf("send Advertise: %v", err)
		}
		e, ok := r.end(5 * time.Second)
		if !ok || status.Code(e.err) != codes.InvalidArgument || !strings.Contains(e.err.Error(), "agent_id") {
			t.Fatalf("Advertise with id %.20q: ended %v with %s, want INVALID_ARGUMENT naming agent_id", id, ok, limStatus(e.err))
		}
	}
	if n := c.mustStats(t).Sessions; n != 0 {
		t.Fatalf("%d sessions registered", n)
	}
}

// TestOversizedHeadersAreRefusedBeforeAuth: the control plane takes at most
// 16 KiB of request headers, so a client without a token cannot make it
// hold megabytes per connection; an agent's headers are far below.
func TestOversizedHeadersAreRefusedBeforeAuth(t *testing.T) {
	c := startCaddy(t, siteAll)
	cc := limControlClient(t, c)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	ctx = metadata.AppendToOutgoingContext(ctx, "x-pad", strings.Repeat("p", 64<<10))
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err == nil {
		_, err = st.Recv()
	}
	if err == nil || ctx.Err() != nil {
		t.Fatalf("Connect with 64 KiB of headers: %v (context %v), want refused", err, ctx.Err())
	}
	t.Logf("refused: %s", limStatus(err))
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("an agent after the refusal: %d", code)
	}
}

// TestAdvertiseTimeout: a stream that never sends its Advertise is failed
// with DEADLINE_EXCEEDED after advertise_timeout.
func TestAdvertiseTimeout(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\tadvertise_timeout 300ms"}, siteAll)
	cc := limControlClient(t, c)
	r := limOpenRaw(t, cc)
	e, ok := r.end(5 * time.Second)
	if !ok {
		t.Fatal("a stream that sent no Advertise is still open after 5s")
	}
	if status.Code(e.err) != codes.DeadlineExceeded {
		t.Fatalf("stream ended with %s, want DeadlineExceeded", limStatus(e.err))
	}
	if e.took < 250*time.Millisecond || e.took > 3*time.Second {
		t.Fatalf("stream failed after %v, want about 300ms", e.took)
	}
	t.Logf("failed after %v: %s", e.took, limStatus(e.err))

	// An agent advertising at once is served.
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from app") {
		t.Fatalf("agent after the timeout: %d %q", code, body)
	}
}

// TestMaxSessions: a third agent is refused with RESOURCE_EXHAUSTED and
// keeps retrying while the first two serve; it connects once one leaves.
func TestMaxSessions(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\tmax_sessions 2"}, siteAll)
	upA, upB, upC := startUpstream(t, "A"), startUpstream(t, "B"), startUpstream(t, "C")
	first := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "a.test", Target: upA})
	startAgent(t, c.serverURL(), "agent-b", agent.Upstream{Host: "b.test", Target: upB})
	third, logs := launchAgentObserved(t, c.serverURL(), "agent-c", agent.Upstream{Host: "c.test", Target: upC})

	refusals := func() *observer.ObservedLogs {
		return logs.FilterMessage("connection failed; retrying").FilterField(zap.String("code", codes.ResourceExhausted.String()))
	}
	eventually(t, 10*time.Second, "the third agent refused twice with RESOURCE_EXHAUSTED", func() bool { return refusals().Len() >= 2 })
	if reason, _ := refusals().All()[0].ContextMap()["reason"].(string); !strings.Contains(reason, "max_sessions") {
		t.Fatalf("refusal reason %q does not name max_sessions", reason)
	}
	eventually(t, 5*time.Second, "the third agent waiting to retry", func() bool { return third.State() == agent.StateRetrying })
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if err := third.WaitConnected(ctx); err == nil || third.Sessions() != 0 {
		t.Fatalf("the third agent connected past max_sessions (sessions %d)", third.Sessions())
	}
	for _, tc := range []struct{ host, want string }{{"a.test", "Hello from A"}, {"b.test", "Hello from B"}} {
		if code, body := get(t, c, tc.host, "/"); code != 200 || !strings.Contains(body, tc.want) {
			t.Fatalf("%s while the third agent is refused: %d %q", tc.host, code, body)
		}
	}
	if code, _ := get(t, c, "c.test", "/"); code != http.StatusServiceUnavailable {
		t.Fatalf("c.test served with the third agent refused: %d", code)
	}
	if st := c.mustStats(t); st.Sessions != 2 {
		t.Fatalf("%d sessions, want 2", st.Sessions)
	}
	t.Logf("third agent refused %d times so far", refusals().Len())

	first.stop()
	waitConnected(t, third)
	if code, body := get(t, c, "c.test", "/"); code != 200 || !strings.Contains(body, "Hello from C") {
		t.Fatalf("c.test after the third agent connected: %d %q", code, body)
	}
	if code, _ := get(t, c, "b.test", "/"); code != 200 {
		t.Fatalf("b.test: %d", code)
	}
}

// TestMaxPendingStreamsPerAddress: of three streams that do not advertise,
// one is refused with RESOURCE_EXHAUSTED at once; when a waiting one goes
// away, a new stream is admitted.
func TestMaxPendingStreamsPerAddress(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\tmax_pending_streams_per_address 2\n\t\tadvertise_timeout 10s"}, siteAll)
	cc := limControlClient(t, c)
	streams := []*limRawStream{limOpenRaw(t, cc), limOpenRaw(t, cc), limOpenRaw(t, cc)}

	// The server may take the three in any order: exactly one is refused.
	var refused []int
	deadline := time.After(1500 * time.Millisecond)
wait:
	for {
		for i, r := range streams {
			if e, ok := r.end(0); ok && !slices.Contains(refused, i) {
				refused = append(refused, i)
				if status.Code(e.err) != codes.ResourceExhausted || !strings.Contains(status.Convert(e.err).Message(), "max_pending_streams_per_address") {
					t.Fatalf("stream %d ended with %s, want ResourceExhausted naming max_pending_streams_per_address", i, limStatus(e.err))
				}
				if e.took > time.Second {
					t.Fatalf("stream %d refused after %v, want at once", i, e.took)
				}
				t.Logf("stream %d refused after %v: %s", i, e.took, limStatus(e.err))
			}
		}
		select {
		case <-deadline:
			break wait
		case <-time.After(10 * time.Millisecond):
		}
	}
	if len(refused) != 1 {
		t.Fatalf("%d of 3 streams refused, want 1", len(refused))
	}

	// One waiting stream goes away: its place is free for an agent.
	for i, r := range streams {
		if i != refused[0] {
			r.cancel()
			break
		}
	}
	attempts := 0
	eventually(t, 5*time.Second, "a new stream admitted and acknowledged", func() bool {
		attempts++
		r := limOpenRaw(t, cc)
		defer r.cancel()
		if err := r.advertise("raw-agent"); err != nil {
			return false
		}
		select {
		case f := <-r.frames:
			return f.GetAdvertiseAck() != nil
		case <-r.done:
			return false
		case <-time.After(2 * time.Second):
			return false
		}
	})
	t.Logf("admitted after %d attempt(s)", attempts)
}

// TestDrainOnShutdown: caddy.Stop lets the response in flight finish, tells
// the agent to drain, refuses new agent streams with UNAVAILABLE while a
// TCP relay is still running, ends as soon as the relay ends, and the agent
// reconnects when Caddy is back.
func TestDrainOnShutdown(t *testing.T) {
	// Long enough for the checks made during the drain on a loaded
	// machine; the test ends as soon as the relay does.
	const grace = 10 * time.Second
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("\t\tdrain_grace 10s\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind 127.0.0.1", port, port)}, siteAll)
	up := startUpstream(t, "app")
	echo := limEchoServer(t)
	a, logs := launchAgentObserved(t, c.serverURL(), "agent-a",
		agent.Upstream{Host: "app.test", Target: up},
		agent.Upstream{ListenPort: port, Target: fmt.Sprintf("tcp://127.0.0.1:%d", echo)})
	waitConnected(t, a)
	tcpAddr := fmt.Sprintf("127.0.0.1:%d", port)
	var relay net.Conn
	eventually(t, 10*time.Second, "a TCP relay through the listen port", func() bool {
		conn, err := net.DialTimeout("tcp", tcpAddr, time.Second)
		if err != nil {
			return false
		}
		if echoWithin(conn, "before", 2*time.Second) != nil {
			conn.Close()
			return false
		}
		relay = conn
		return true
	})
	defer relay.Close()
	sessions := a.Sessions()

	// A slow response in flight: five events over about 800ms.
	cl := limClient()
	defer cl.CloseIdleConnections()
	resp, err := cl.Do(limRequest(context.Background(), c, "GET", "app.test", "/sse?n=5&every=200ms", nil))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	br := bufio.NewReader(resp.Body)
	events := 0
	readEvent := func() error {
		for {
			line, err := br.ReadString('\n')
			if err != nil {
				return err
			}
			if strings.HasPrefix(line, "data: ") {
				events++
				return nil
			}
		}
	}
	if err := readEvent(); err != nil {
		t.Fatalf("first event: %v", err)
	}
	// A finished request leaves an idle pooled connection, which is not
	// in flight: the drain must not wait for it.
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("status %d", code)
	}
	if st := c.mustStats(t); st.Connections < 3 {
		t.Fatalf("before Stop: %d connections, want the relay, the stream and an idle one", st.Connections)
	}

	stopStart := time.Now()
	stopped := make(chan time.Duration, 1)
	go func() {
		caddy.Stop()
		stopped <- time.Since(stopStart)
	}()

	// The response completes in full.
	for events < 5 {
		if err := readEvent(); err != nil {
			t.Fatalf("after %d events: %v", events, err)
		}
	}
	if rest, err := io.ReadAll(br); err != nil || strings.Contains(string(rest), "data: ") {
		t.Fatalf("end of the stream: %q, %v", rest, err)
	}
	t.Logf("response complete %v after Stop began", time.Since(stopStart))

	// The HTTP servers stopped, the node drains: the agent is told, and a
	// new agent stream is refused.
	eventually(t, 5*time.Second, "the agent told to drain", func() bool { return logs.FilterMessage("node draining").Len() > 0 })
	r := limOpenRaw(t, limControlClient(t, c))
	e, ok := r.end(3 * time.Second)
	if !ok || status.Code(e.err) != codes.Unavailable || !strings.Contains(status.Convert(e.err).Message(), "node is draining") {
		t.Fatalf("agent stream during the drain: ended %v, %s; want Unavailable \"node is draining\"", ok, limStatus(e.err))
	}
	// The relay in flight keeps working during the drain, which waits for it.
	if err := echoWithin(relay, "during the drain", 2*time.Second); err != nil {
		t.Fatalf("relay during the drain: %v", err)
	}
	select {
	case d := <-stopped:
		t.Fatalf("caddy.Stop returned after %v with a TCP relay in flight", d)
	default:
	}

	// The relay ends: the drain is over, with nothing else to wait for.
	relayEnd := time.Now()
	relay.Close()
	var stopTook time.Duration
	select {
	case stopTook = <-stopped:
	case <-time.After(grace + 2*time.Second):
		t.Fatalf("caddy.Stop still running %v after it began", time.Since(stopStart))
	}
	afterRelay := time.Since(relayEnd)
	t.Logf("caddy.Stop took %v, %v after the last relay ended", stopTook, afterRelay)
	if stopTook > grace+2*time.Second {
		t.Fatalf("caddy.Stop took %v, want within drain_grace + 2s", stopTook)
	}
	if afterRelay > 1500*time.Millisecond {
		t.Fatalf("the drain went on %v after the last connection ended", afterRelay)
	}

	eventually(t, 5*time.Second, "the agent sees the drained session end", func() bool {
		return logs.FilterMessage("disconnected: node drained; reconnecting").Len() > 0
	})
	c.load(siteAll)
	eventually(t, 15*time.Second, "the agent reconnects to the restarted Caddy", func() bool {
		code, _ := get(t, c, "app.test", "/")
		return code == 200
	})
	if a.Sessions() <= sessions {
		t.Fatalf("sessions %d, want more than %d", a.Sessions(), sessions)
	}
}

// TestMemoryBoundedWithStalledPeers: eight downloads whose clients stop
// reading and eight uploads whose upstream stops reading hold, by the
// implementation's accounting, no more than their initial windows plus the
// tunnel budget, on the node and on the agent; all of it is released when
// they end.
func TestMemoryBoundedWithStalledPeers(t *testing.T) {
	const conns = 8
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\ttunnel_budget 4MiB"}, siteAll)
	app := startUpstream(t, "app")
	hold := startLimHoldUpstream(t)
	// On the lane: this is its accounting. A direct socket's stalled bytes
	// wait in the kernel's socket buffers, which bound them instead.
	a := startAgentWith(t, c.serverURL(), "agent-a", func(cfg *agent.Config) { cfg.TunnelBudget = 4 << 20; cfg.DisableDirectSockets = true },
		agent.Upstream{Host: "dl.test", Target: app},
		agent.Upstream{Host: "ul.test", Target: hold.url})
	budget := c.mustStats(t).BudgetLimit
	if budget != 4<<20 {
		t.Fatalf("BudgetLimit %d, want 4MiB", budget)
	}
	runtime.GC()
	rssBefore := procRSS(t)

	var downloads []net.Conn
	for i := 0; i < conns; i++ {
		conn, head := limStalledDownload(t, c, "dl.test", fmt.Sprintf("/download?size=%d", 512<<20))
		if !strings.Contains(head, " 200 ") {
			t.Fatalf("download %d: %s", i, head)
		}
		downloads = append(downloads, conn)
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	cl := limClient()
	defer cl.CloseIdleConnections()
	uploads := make(chan error, conns)
	for i := 0; i < conns; i++ {
		go func() {
			req := limRequest(ctx, c, "POST", "ul.test", "/stall", limZeroReader{})
			req.ContentLength = -1
			resp, err := cl.Do(req)
			if err == nil {
				io.Copy(io.Discard, resp.Body)
				resp.Body.Close()
			}
			uploads <- err
		}()
	}
	for i := 0; i < conns; i++ {
		select {
		case <-hold.arrived:
		case err := <-uploads:
			t.Fatalf("upload %d ended early: %v", i, err)
		case <-time.After(10 * time.Second):
			t.Fatalf("only %d of %d uploads reached the upstream", i, conns)
		}
	}

	// What the implementation promises: a receive window holds at most 64
	// KiB outside the budget, a send queue at most SendQueue. The node
	// receives the eight downloads, the agent the eight uploads; each end's
	// windows grow against its own 4 MiB budget.
	n := int64(2 * conns)
	queueBound := n * tunnelcore.DefaultSendQueue
	nodeBufBound := int64(conns)*tunnelcore.InitialWindow + budget
	agentBufBound := int64(conns)*tunnelcore.InitialWindow + 4<<20
	tight := n*tunnelcore.InitialWindow + budget // 16 x 64 KiB + budget
	var nodePeak, agentPeak, nodeBufPeak, agentBufPeak, nodeQPeak, agentQPeak, budgetPeak int64
	var violation string
	tick := time.NewTicker(20 * time.Millisecond)
	defer tick.Stop()
	sampleStart := time.Now()
	for i := 0; i < 100; i++ {
		<-tick.C
		st := c.mustStats(t)
		as := a.Stats()
		nodePeak, agentPeak = max(nodePeak, st.Buffered+st.Queued), max(agentPeak, as.Buffered+as.Queued)
		nodeBufPeak, agentBufPeak = max(nodeBufPeak, st.Buffered), max(agentBufPeak, as.Buffered)
		nodeQPeak, agentQPeak = max(nodeQPeak, st.Queued), max(agentQPeak, as.Queued)
		budgetPeak = max(budgetPeak, st.BudgetInUse)
		switch {
		case violation != "":
		case st.Buffered > nodeBufBound || st.Queued > queueBound:
			violation = fmt.Sprintf("sample %d: node buffered %d (bound %d), queued %d (bound %d)", i, st.Buffered, nodeBufBound, st.Queued, queueBound)
		case as.Buffered > agentBufBound || as.Queued > queueBound:
			violation = fmt.Sprintf("sample %d: agent buffered %d (bound %d), queued %d (bound %d)", i, as.Buffered, agentBufBound, as.Queued, queueBound)
		case st.BudgetInUse > budget:
			violation = fmt.Sprintf("sample %d: budget in use %d past %d", i, st.BudgetInUse, budget)
		}
		if st.Connections != 2*conns {
			t.Fatalf("sample %d: %d connections, want %d", i, st.Connections, 2*conns)
		}
	}
	rssAfter := procRSS(t)
	growth := rssAfter - rssBefore
	t.Logf("%d samples over %v", 100, time.Since(sampleStart).Round(time.Millisecond))
	t.Logf("node: peak buffered+queued %d KiB (buffered %d KiB of %d, queued %d KiB of %d), budget in use peak %d KiB of %d",
		nodePeak>>10, nodeBufPeak>>10, nodeBufBound>>10, nodeQPeak>>10, queueBound>>10, budgetPeak>>10, budget>>10)
	t.Logf("agent: peak buffered+queued %d KiB (buffered %d KiB of %d, queued %d KiB of %d)",
		agentPeak>>10, agentBufPeak>>10, agentBufBound>>10, agentQPeak>>10, queueBound>>10)
	t.Logf("16 x 64 KiB + budget = %d KiB: node within it %v, agent within it %v", tight>>10, nodePeak <= tight, agentPeak <= tight)
	t.Logf("RSS %d MiB -> %d MiB (%+d MiB)", rssBefore>>20, rssAfter>>20, growth>>20)
	if violation != "" {
		t.Error(violation)
	}
	if nodeBufPeak == 0 || agentBufPeak == 0 {
		t.Fatalf("the stalls did not reach the tunnel: node buffered peak %d, agent buffered peak %d", nodeBufPeak, agentBufPeak)
	}
	// A sanity bound on the whole process; the race detector's shadow
	// memory multiplies what the test touches.
	rssBound := 64<<20 + budget
	if raceBuild() {
		rssBound *= 4
	}
	if growth > rssBound {
		t.Errorf("RSS grew %d MiB, sanity bound %d MiB", growth>>20, rssBound>>20)
	}

	// End them: everything held is released.
	for _, conn := range downloads {
		conn.Close()
	}
	cancel()
	hold.release()
	eventually(t, 10*time.Second, "the stalled connections released", func() bool {
		st := c.mustStats(t)
		as := a.Stats()
		return st.Buffered == 0 && st.Queued == 0 && st.Connections == 0 && st.BudgetInUse == 0 &&
			as.Buffered == 0 && as.Queued == 0 && as.Conns == 0
	})
}

// TestAgentConnectCyclesLeakNothing: 100 agent sessions, each serving one
// request, leave no goroutine or file descriptor behind.
func TestAgentConnectCyclesLeakNothing(t *testing.T) {
	start := time.Now()
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	cycle := func(i int) {
		t.Helper()
		a := startAgent(t, c.serverURL(), "agent-cycle", agent.Upstream{Host: "app.test", Target: up})
		resp, err := cl.Do(limRequest(context.Background(), c, "GET", "app.test", "/", nil))
		if err != nil {
			t.Fatalf("cycle %d: %v", i, err)
		}
		b, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != 200 || !strings.Contains(string(b), "Hello from app") {
			t.Fatalf("cycle %d: %d %q", i, resp.StatusCode, b)
		}
		a.stop()
		eventually(t, 5*time.Second, fmt.Sprintf("cycle %d: the session gone", i), func() bool {
			return c.mustStats(t).Sessions == 0
		})
	}
	cycle(0)
	baseG, baseFD := runtime.NumGoroutine(), procFDs(t)
	for i := 1; i < 100; i++ {
		cycle(i)
	}
	var g, fd int
	eventually(t, 10*time.Second, "goroutines and fds back to the baseline", func() bool {
		g, fd = runtime.NumGoroutine(), procFDs(t)
		return g <= baseG+10 && fd <= baseFD+5
	})
	t.Logf("100 cycles in %v; goroutines %d -> %d, fds %d -> %d", time.Since(start), baseG, g, baseFD, fd)
	if st := c.mustStats(t); st.SlotsInUse != 0 || st.Connections != 0 || st.BudgetInUse != 0 {
		t.Fatalf("after the cycles: %+v", st)
	}
	if d := time.Since(start); d > 60*time.Second {
		t.Fatalf("100 cycles took %v, want under 60s", d)
	}
}

// TestAgentLimitFreesIdlePooledConnections: the node's idle pooled HTTP
// connections count against the agent's max_connections. When the agent
// refuses a connection at that limit, the request is answered 503 with
// Retry-After (its upstream never saw it), and the idle connections are
// closed, so the agent's other routes are served again at once instead of
// after the transport's idle timeout.
func TestAgentLimitFreesIdlePooledConnections(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true}, siteAll)
	const limit = 4
	var arrived atomic.Int32
	all := make(chan struct{})
	up := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.Host == "a.test" && arrived.Add(1) == limit {
			close(all)
		}
		if r.Host == "a.test" {
			select { // hold each a.test request until all are in: limit connections at once
			case <-all:
			case <-time.After(10 * time.Second):
			}
		}
		io.WriteString(w, r.Host)
	}))
	defer up.Close()
	startAgentWith(t, c.serverURL(), "agent-a", func(cfg *agent.Config) { cfg.MaxConnections = limit },
		agent.Upstream{Host: "a.test", Target: up.URL}, agent.Upstream{Host: "b.test", Target: up.URL})

	codes := make(chan int, limit)
	for range limit {
		go func() { code, _ := get(t, c, "a.test", "/"); codes <- code }()
	}
	for range limit {
		if code := <-codes; code != 200 {
			t.Fatalf("a.test: %d", code)
		}
	}
	// The limit connections to a.test are idle in the node's pool now.
	req, _ := http.NewRequest("GET", c.url("/"), nil)
	req.Host = "b.test"
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	switch {
	case resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") != "":
		t.Logf("refused at the agent's limit, as expected: %q", body)
	case resp.StatusCode != 200:
		t.Fatalf("b.test with the agent's connections idle in the pool: %d %q, want 200 or 503 with Retry-After", resp.StatusCode, body)
	}
	eventually(t, 10*time.Second, "b.test served", func() bool {
		code, body := get(t, c, "b.test", "/")
		if code != 200 && code != http.StatusServiceUnavailable {
			t.Fatalf("b.test: %d %q", code, body)
		}
		return code == 200 && body == "b.test"
	})
}

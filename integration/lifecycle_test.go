package integration

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/coder/websocket"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/agent"
)

func TestAgentGoneAnswers503AndComesBack(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("status %d", code)
	}
	a.stop()
	// Requests get 503 within a second, without hanging.
	start := time.Now()
	eventually(t, time.Second, "503 after the agent stopped", func() bool {
		code, _ := get(t, c, "app.test", "/")
		return code == http.StatusServiceUnavailable
	})
	t.Logf("503 after %v", time.Since(start))

	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from app") {
		t.Fatalf("after restart: %d %q", code, body)
	}
}

func TestUpstreamDownIs502WithReason(t *testing.T) {
	c := startCaddy(t, siteAll)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "down.test", Target: fmt.Sprintf("http://127.0.0.1:%d", freePort(t))})
	if code, _ := get(t, c, "down.test", "/"); code != http.StatusBadGateway {
		t.Fatalf("status %d, want 502", code)
	}
}

func TestCaddyRestartAgentReconnects(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	caddyStop(t)
	eventually(t, 10*time.Second, "agent notices the node is gone", func() bool { return a.State() != agent.StateConnected })
	c.load(siteAll) // a fresh Caddy on the same ports
	eventually(t, 15*time.Second, "agent reconnects by itself", func() bool {
		code, _ := get(t, c, "app.test", "/")
		return code == 200
	})
}

func TestWrongTokenIsRejectedAndRetried(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a := launchAgent(t, c.serverURL(), "agent-bad", "not-the-token", agent.Upstream{Host: "app.test", Target: up})
	// It never connects, keeps retrying, and the host stays unserved.
	eventually(t, 10*time.Second, "agent retrying after rejection", func() bool { return a.State() == agent.StateRetrying })
	ctx, cancel := context.WithTimeout(context.Background(), 1500*time.Millisecond)
	defer cancel()
	if err := a.WaitConnected(ctx); err == nil {
		t.Fatal("agent with a wrong token connected")
	}
	if code, _ := get(t, c, "app.test", "/"); code != http.StatusServiceUnavailable {
		t.Fatalf("status %d, want 503", code)
	}
}

// TestAgentRereadsItsTokenFile: an agent whose token_file held a stale
// token connects once the file holds the node's, without a restart: token
// rotation is a file write on each agent host and a reload of Caddy.
func TestAgentRereadsItsTokenFile(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	file := filepath.Join(t.TempDir(), "token")
	if err := os.WriteFile(file, []byte("the-previous-token-0123456789abcdef\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	a, logs := launchAgentLogged(t, c.serverURL(), "agent-file", "", func(cfg *agent.Config) { cfg.TokenFile = file }, true,
		agent.Upstream{Host: "app.test", Target: up})
	eventually(t, 10*time.Second, "the stale token rejected", func() bool {
		return logs.FilterMessage("authentication failed; retrying").Len() > 0
	})
	if err := os.WriteFile(file, []byte(testToken+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	waitConnected(t, a)
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("after the token file was updated: %d", code)
	}
	if logs.FilterMessage("token_file holds a new token; using it").Len() != 1 {
		t.Fatal("the agent did not log the new token once")
	}
}

func TestReconnectDisplacesOldSession(t *testing.T) {
	c := startCaddy(t, siteAll)
	upOld, upNew := startUpstream(t, "first"), startUpstream(t, "second")
	first := startAgent(t, c.serverURL(), "same-id", agent.Upstream{Host: "app.test", Target: upOld})
	second := startAgent(t, c.serverURL(), "same-id", agent.Upstream{Host: "app.test", Target: upNew})
	if _, body := get(t, c, "app.test", "/"); !strings.Contains(body, "Hello from second") {
		t.Fatalf("newer session must serve: %q", body)
	}
	first.stop() // the displaced session's late end must not evict the new one
	// The displaced first agent reconnects after its backoff and may have
	// displaced the second once more before it stopped; the second then
	// comes back after its own.
	waitConnected(t, second)
	eventually(t, 10*time.Second, "the second agent serving", func() bool {
		_, body := get(t, c, "app.test", "/")
		return strings.Contains(body, "Hello from second")
	})
	for i := 0; i < 20; i++ {
		if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from second") {
			t.Fatalf("request %d after the first agent stopped: %d %q", i, code, body)
		}
	}
}

// TestDisplacedSessionEndsAndFreesItsPlace: the session a newer stream of
// the same agent id replaced is closed (ABORTED, which the displaced agent
// logs as a likely id clash) and gives back its place in max_sessions, so
// reusing an id neither stacks sessions nor locks other agents out.
func TestDisplacedSessionEndsAndFreesItsPlace(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: "max_sessions 2", CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	first, logs := launchAgentObserved(t, c.serverURL(), "same-id", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, first)
	second := startAgent(t, c.serverURL(), "same-id", agent.Upstream{Host: "app.test", Target: up})
	eventually(t, 10*time.Second, "the displaced agent told why", func() bool {
		return logs.FilterMessageSnippet("replaced by another connection with this agent id").Len() > 0
	})
	// The node warns too: a session replaced seconds after it connected is
	// most likely one of two agents sharing an id.
	eventually(t, 10*time.Second, "the node's warning", func() bool {
		for _, line := range c.logLines(t, "agent session replaced by a newer stream soon after it connected; are two agents running with this id?") {
			if bytes.Contains(line, []byte(`"level":"warn"`)) && bytes.Contains(line, []byte(`"agent":"same-id"`)) {
				return true
			}
		}
		return false
	})
	// Before the fix the displaced session stayed open beside the new one.
	eventually(t, 5*time.Second, "one session left", func() bool { return c.mustStats(t).Sessions == 1 })
	first.stop() // two live agents of one id would keep displacing each other
	// The first may have displaced the second once more before it stopped;
	// the second then comes back after its backoff.
	waitConnected(t, second)
	other := startAgent(t, c.serverURL(), "other-id", agent.Upstream{Host: "other.test", Target: up})
	waitConnected(t, other)
	eventually(t, 10*time.Second, "two sessions (max_sessions 2): same-id and other-id", func() bool {
		return c.mustStats(t).Sessions == 2 && second.State() == agent.StateConnected
	})
}

func TestReloadKeepsInFlightDownloadAndWebSocket(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	sessions := a.Sessions()

	// A 200 MiB download read slowly enough to span the reload.
	const size = 200 << 20
	req, _ := http.NewRequest("GET", c.url(fmt.Sprintf("/download?size=%d", size)), nil)
	req.Host = "app.test"
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	firstChunk := make([]byte, 1<<20)
	if _, err := io.ReadFull(resp.Body, firstChunk); err != nil {
		t.Fatal(err)
	}
	ws := dialWS(t, c, "app.test")
	defer ws.CloseNow()
	echoWS(t, ws, 10)

	// Reload with a changed config: a new site.
	reloadWithNewSite(t, c, siteAll)
	rest, err := io.Copy(io.Discard, resp.Body)
	if err != nil || int64(len(firstChunk))+rest != size {
		t.Fatalf("download across reload: %d of %d bytes, %v", int64(len(firstChunk))+rest, size, err)
	}
	echoWS(t, ws, 100)
	ws.Close(websocket.StatusNormalClosure, "")

	if a.Sessions() != sessions || a.State() != agent.StateConnected {
		t.Fatalf("the reload reconnected the agent: sessions %d→%d, state %v", sessions, a.Sessions(), a.State())
	}
	// And the tunnel still serves new requests under the new config.
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("after reload: %d", code)
	}
}

// TestFailedReloadIsRefusedAndTheRunningConfigGoesOn: a reload whose sluice
// app cannot load (its certificate file is missing) is refused with the field
// named; Caddy does not crash on the way out (the sluice handler's Cleanup
// runs after its failed Provision), and the agent and its route stay.
func TestFailedReloadIsRefusedAndTheRunningConfigGoesOn(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	sessions := a.Sessions()

	missing := filepath.Join(t.TempDir(), "no-such")
	err := c.tryLoadGlobal(fmt.Sprintf("\tsluice {\n\t\ttls %s.crt %s.key\n\t}", missing, missing), siteAll)
	if err == nil || !strings.Contains(err.Error(), "tls_cert_file") || !strings.Contains(err.Error(), "no such file") {
		t.Fatalf("reload with a missing certificate: got %v, want an error naming tls_cert_file", err)
	}
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "app") {
		t.Fatalf("after the refused reload: %d %q", code, body)
	}
	if a.Sessions() != sessions || a.State() != agent.StateConnected {
		t.Fatalf("the refused reload reconnected the agent: sessions %d→%d, state %v", sessions, a.Sessions(), a.State())
	}
}

// TestLbTryDurationWaitsForAnAgent: with lb_try_duration, a request for a
// host no agent serves yet waits for one (an agent restarting, say) and is
// served when it comes; with none coming, it gets the readable 503 once the
// try duration is over.
func TestLbTryDurationWaitsForAnAgent(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true}, "http://:{HTTP} {\n\tsluice {\n\t\tlb_try_duration 10s\n\t}\n}\n\nhttp://short.test:{HTTP} {\n\tsluice {\n\t\tlb_try_duration 300ms\n\t}\n}")
	up := startUpstream(t, "late")

	type answer struct {
		code int
		body string
	}
	done := make(chan answer, 1)
	go func() {
		code, body := get(t, c, "app.test", "/")
		done <- answer{code, body}
	}()
	eventually(t, 5*time.Second, "the request waiting for an agent", func() bool { return c.mustStats(t).AwaitingAgent == 1 })
	startAgent(t, c.serverURL(), "late-agent", agent.Upstream{Host: "app.test", Target: up})
	select {
	case a := <-done:
		if a.code != 200 || !strings.Contains(a.body, "late") {
			t.Fatalf("the waiting request: %d %q, want 200 from the agent that came", a.code, a.body)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("the waiting request was not served after its agent came")
	}

	start := time.Now()
	code, body := get(t, c, "short.test", "/")
	if code != 503 || !strings.Contains(body, "no sluice agent is connected for short.test") {
		t.Fatalf("no agent within lb_try_duration: %d %q, want the readable 503", code, body)
	}
	if waited := time.Since(start); waited < 300*time.Millisecond {
		t.Fatalf("answered 503 after %v, before lb_try_duration 300ms", waited)
	}
	if n := c.mustStats(t).AwaitingAgent; n != 0 {
		t.Fatalf("%d requests still counted as waiting", n)
	}
}

// TestTokenChangeEndsSessionsOfTheOldToken: a reload that rotates the token
// ends the sessions that authenticated with the old one (their agents are
// told UNAUTHENTICATED and keep being refused), and agents holding the new
// token are served; a reload that keeps the token ends nothing.
func TestTokenChangeEndsSessionsOfTheOldToken(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	old, logs := launchAgentObserved(t, c.serverURL(), "agent-old", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, old)
	sessions := old.Sessions()

	reloadWithNewSite(t, c, siteAll)
	if old.Sessions() != sessions || old.State() != agent.StateConnected {
		t.Fatal("a reload that kept the token ended the session")
	}

	const rotated = "rotated-token-0123456789abcdef0123456789"
	c.opts.Sluice = "token " + rotated
	c.load(siteAll)
	eventually(t, 10*time.Second, "the old token's agent told it is no longer authenticated", func() bool {
		return logs.FilterMessage("authentication failed; retrying").Len() > 0
	})
	if code, _ := getAfterReload(t, c, "app.test", "/"); code != http.StatusServiceUnavailable {
		t.Fatalf("with only an old-token agent: %d, want 503", code)
	}
	a, _ := launchAgentLogged(t, c.serverURL(), "agent-new", rotated, nil, false, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("with an agent holding the new token: %d", code)
	}
}

// TestTokenChangeReachesStreamsWaitingToAdvertise: a stream whose token was
// checked before a reload rotated it, and that advertises after, is ended
// too: the reload's sweep could not see it yet.
func TestTokenChangeReachesStreamsWaitingToAdvertise(t *testing.T) {
	c := startCaddy(t, siteAll)
	r := limOpenRaw(t, limControlClient(t, c))
	eventually(t, 5*time.Second, "the stream authorized and awaiting its Advertise", func() bool { return c.mustStats(t).PendingStreams == 1 })
	c.opts.Sluice = "token rotated-token-0123456789abcdef0123456789"
	c.load(siteAll)
	if err := r.advertise("old-token-holder"); err != nil {
		t.Fatal(err)
	}
	e, ok := r.end(10 * time.Second)
	if !ok || status.Code(e.err) != codes.Unauthenticated {
		t.Fatalf("old-token stream after the rotation: ended %v with %s, want UNAUTHENTICATED", ok, limStatus(e.err))
	}
	eventually(t, 5*time.Second, "no session left", func() bool { return c.mustStats(t).Sessions == 0 })
}

// TestFailedReloadWithRotatedTokenKeepsSessions: a reload that rotates the
// token but fails to start (another app cannot bind its port) is rolled
// back, the running config and its token go on, and so do its agents'
// sessions: the old token's sessions end only once a reload took over.
func TestFailedReloadWithRotatedTokenKeepsSessions(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	a, logs := launchAgentObserved(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	sessions := a.Sessions()

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	failing := siteAll + fmt.Sprintf("\n\nhttp://127.0.0.1:%d {\n\tbind 127.0.0.1\n\trespond \"unreachable\"\n}", busy.Addr().(*net.TCPAddr).Port)
	c.opts.Sluice = "token rotated-token-0123456789abcdef0123456789"
	for i := range 8 {
		if err := c.tryLoadGlobal("", failing); err == nil {
			t.Fatalf("attempt %d: a config binding a busy port loaded", i)
		}
	}
	c.opts.Sluice = ""
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("after the rolled-back reloads: %d, want 200", code)
	}
	if got := a.Sessions(); got != sessions || logs.FilterMessage("authentication failed; retrying").Len() > 0 {
		t.Fatalf("rolled-back reloads ended the agent's session: sessions %d -> %d, %d authentication failures",
			sessions, got, logs.FilterMessage("authentication failed; retrying").Len())
	}
}

// TestStaleTokenStreamCannotDisplaceAValidSession: a stream authorized
// with the token a reload rotated away, and advertising after the reload
// as an agent id that holds the new token, is refused before it is
// registered: it does not replace that agent's session.
func TestStaleTokenStreamCannotDisplaceAValidSession(t *testing.T) {
	c := startCaddy(t, siteAll)
	up := startUpstream(t, "app")
	stale := limOpenRaw(t, limControlClient(t, c))
	eventually(t, 5*time.Second, "the old-token stream awaiting its Advertise", func() bool { return c.mustStats(t).PendingStreams == 1 })

	const rotated = "rotated-token-0123456789abcdef0123456789"
	c.opts.Sluice = "token " + rotated
	c.load(siteAll)
	a, logs := launchAgentLogged(t, c.serverURL(), "agent-x", rotated, nil, true, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	sessions := a.Sessions()

	if err := stale.advertise("agent-x"); err != nil {
		t.Fatal(err)
	}
	e, ok := stale.end(10 * time.Second)
	if !ok || status.Code(e.err) != codes.Unauthenticated {
		t.Fatalf("old-token stream after the rotation: ended %v with %s, want UNAUTHENTICATED", ok, limStatus(e.err))
	}
	if code, _ := get(t, c, "app.test", "/"); code != 200 {
		t.Fatalf("the new-token agent after the stale stream: %d, want 200", code)
	}
	if got := a.Sessions(); got != sessions || logs.FilterMessageSnippet("replaced by another connection").Len() > 0 {
		t.Fatalf("the stale-token stream displaced the new-token agent's session: sessions %d -> %d", sessions, got)
	}
}

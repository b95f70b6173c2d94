package integration

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Direct sockets (proto/README §2.5): a connection that carried 1 MiB
// moves off the data lane to a socket of its own. Every test with a larger
// body runs through one; these check that it happens, over plaintext and
// TLS, that either end can turn it off (a reload included), that the door
// is shut to strangers, that a burst of them fits the pending-connection
// guard, that a path with no room for them falls back to the lane, and that
// half-close crosses them.

// TestBulkConnectionsGoDirect: a download and an upload through Caddy move
// to direct sockets and arrive intact; small requests on the same agent
// stay on the lane.
func TestBulkConnectionsGoDirect(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a, logs := launchAgentObserved(t, c.serverURL(), "direct-agent", agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "direct-agent", "direct_sockets", true)

	if code, _ := get(t, c, "app.test", "/"); code != 200 || a.Stats().Direct != 0 {
		t.Fatalf("small GET: %d, direct sockets %d; want 200 on the lane", code, a.Stats().Direct)
	}
	checkDownload(t, c, "app.test", 64<<20)
	if n := a.Stats().Direct; n < 1 {
		t.Fatalf("a 64 MiB download went through %d direct sockets; want one", n)
	}
	checkUpload(t, c, "app.test", 16<<20)
	// What came after a move on a reused connection still works.
	if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "app") {
		t.Fatalf("GET after the bulk transfers: %d %q", code, body)
	}
}

// checkUpload posts size bytes to the upstream's /upload, which answers
// the count and checksum of what it read.
func checkUpload(t testing.TB, c *caddyServer, host string, size int64) {
	t.Helper()
	h := sha256.New()
	io.Copy(h, sampleupstream.Pattern(size))
	want := fmt.Sprintf("%d %x\n", size, h.Sum(nil))
	req, _ := http.NewRequest("POST", c.url("/upload"), sampleupstream.Pattern(size))
	req.Host = host
	req.ContentLength = size
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	got, err := io.ReadAll(resp.Body)
	if err != nil || resp.StatusCode != 200 || string(got) != want {
		t.Fatalf("upload: status %d, answer %q, err %v; want %q", resp.StatusCode, got, err, want)
	}
}

// TestDirectSocketsOverTLS: with a TLS control plane the direct socket
// runs the same TLS handshake as the lane, and a download through it
// arrives intact.
func TestDirectSocketsOverTLS(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option()}, siteAll)
	up := startUpstream(t, "tls-app")
	serverURL := grpcsURL(c)
	a, _ := launchAgentLogged(t, serverURL, "tls-direct", testToken, tn.trust,
		false, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	checkDownload(t, c, "app.test", 32<<20)
	checkUpload(t, c, "app.test", 8<<20)
	if n := a.Stats().Direct; n < 1 {
		t.Fatalf("bulk transfers over a TLS control plane went through %d direct sockets; want some", n)
	}
}

// TestDirectSocketsOff: the node's `direct_sockets off` and the agent's
// disable_direct_sockets each keep every connection on the lane.
func TestDirectSocketsOff(t *testing.T) {
	cases := []struct {
		name   string
		global string
		adjust func(*agent.Config)
	}{
		{"node direct_sockets off", "direct_sockets off", nil},
		{"agent disable_direct_sockets", "", func(cfg *agent.Config) { cfg.DisableDirectSockets = true }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			c := startCaddyWith(t, caddyOptions{Sluice: tc.global, CaptureLog: true}, siteAll)
			up := startUpstream(t, "app")
			a, logs := launchAgentLogged(t, c.serverURL(), "lane-only", testToken, tc.adjust, true,
				agent.Upstream{Host: "app.test", Target: up})
			waitConnected(t, a)
			assertConnectedSays(t, c, logs, "lane-only", "data_lane", true)
			checkDownload(t, c, "app.test", 16<<20)
			if n := a.Stats().Direct; n != 0 {
				t.Fatalf("%d direct sockets; want none", n)
			}
		})
	}
}

// TestDirectSocketRefusesStrangers: a direct socket preface with a key no
// session has, or naming a connection that is not open, is closed without
// the node's 0x01, and the node goes on serving.
func TestDirectSocketRefusesStrangers(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a := launchAgent(t, c.serverURL(), "direct-strangers", testToken, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	addr := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	for _, hello := range [][]byte{
		tunnelpb.DirectHello(strings.Repeat("ab", tunnelpb.DirectKeyLength/2), 2),
		[]byte(tunnelpb.DirectPreface + strings.Repeat("0", tunnelpb.DirectKeyLength) + "not-hex-digits!!\n"),
	} {
		conn, err := net.Dial("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := conn.Write(hello); err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(15 * time.Second))
		got, err := io.ReadAll(conn)
		conn.Close()
		if err != nil || len(got) != 0 {
			t.Errorf("direct preface %q: read %q, %v; want the connection closed with nothing", hello, got, err)
		}
	}
	eventually(t, 5*time.Second, `"direct socket refused" logged`, func() bool {
		return len(c.logLines(t, "direct socket refused")) > 0
	})
	checkDownload(t, c, "app.test", 8<<20)
}

// downloadOK fetches /download?size=size through c for host and compares
// the checksum; it returns what went wrong (usable from goroutines).
func downloadOK(c *caddyServer, host string, size int64) error {
	h := sha256.New()
	io.Copy(h, sampleupstream.Pattern(size))
	want := h.Sum(nil)
	req, _ := http.NewRequest("GET", c.url(fmt.Sprintf("/download?size=%d", size)), nil)
	req.Host = host
	resp, err := hostClient().Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	h.Reset()
	n, err := io.Copy(h, resp.Body)
	if err != nil || n != size || !bytes.Equal(h.Sum(nil), want) || resp.StatusCode != 200 {
		return fmt.Errorf("download: status %d, %d of %d bytes, err %v, checksum ok %v", resp.StatusCode, n, size, err, bytes.Equal(h.Sum(nil), want))
	}
	return nil
}

func parallelDownloads(t *testing.T, c *caddyServer, host string, n int, size int64) {
	t.Helper()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	for range n {
		wg.Add(1)
		go func() { defer wg.Done(); errs <- downloadOK(c, host, size) }()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Errorf("parallel download: %v", err)
		}
	}
}

// A burst of bulk connections from one agent opens its direct sockets a
// few at a time: until each shows its preface it counts against the
// listener guard's max_pending_streams_per_address, which must not refuse
// them.
func TestDirectBurstWithinThePendingGuard(t *testing.T) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option("max_pending_streams_per_address 4"), CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	serverURL := grpcsURL(c)
	a, _ := launchAgentLogged(t, serverURL, "burst", testToken, tn.trust,
		false, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	const n = 12
	parallelDownloads(t, c, "app.test", n, 8<<20)
	refused := c.logLines(t, "control connection refused: too many connections have not presented the token")
	t.Logf("direct sockets: %d of %d; guard refusals logged: %d", a.Stats().Direct, n, len(refused))
	if len(refused) > 0 || a.Stats().Direct == 0 {
		t.Fatalf("direct sockets of an authenticated agent were refused by the unproven-connection guard: %d of %d went direct; %d refusal line(s), first: %s",
			a.Stats().Direct, n, len(refused), firstLine(refused))
	}
}

func firstLine(l [][]byte) string {
	if len(l) == 0 {
		return ""
	}
	return string(l[0])
}

// connsUpTo forwards the first k connections to target and closes later ones.
func connsUpTo(t testing.TB, target string, k int32, seen *atomic.Int32) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	go func() {
		for {
			in, err := lis.Accept()
			if err != nil {
				return
			}
			if seen.Add(1) > k {
				in.Close()
				continue
			}
			out, err := net.Dial("tcp", target)
			if err != nil {
				in.Close()
				continue
			}
			t.Cleanup(func() { in.Close(); out.Close() })
			go func() { io.Copy(out, in); out.Close() }()
			go func() { io.Copy(in, out); in.Close() }()
		}
	}()
	return lis.Addr().String()
}

// A path that takes the lane but no further connection: the agent tries a
// direct socket a few times at most (those opening at once), says so once,
// and the downloads complete on the lane.
func TestDirectUnavailableTriedOncePerPeriod(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	var seen atomic.Int32
	fwd := connsUpTo(t, fmt.Sprintf("127.0.0.1:%d", c.controlPort), 2, &seen)
	a, logs := launchAgentLogged(t, "grpc://"+fwd, "no-direct-path", testToken, nil, true,
		agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	assertConnectedSays(t, c, logs, "no-direct-path", "data_lane", true)
	const n = 5
	parallelDownloads(t, c, "app.test", n, 8<<20)
	checkDownload(t, c, "app.test", 4<<20)
	attempts := seen.Load() - 2
	var said []string
	for _, e := range logs.All() {
		if strings.Contains(strings.ToLower(e.Message), "direct") {
			said = append(said, e.Message)
		}
	}
	t.Logf("direct socket attempts after the lane: %d for %d downloads; agent Info+ lines about it: %q", attempts, n, said)
	if attempts > 4 || len(said) != 1 {
		t.Fatalf("direct sockets unavailable: %d attempts for %d bulk connections (no backoff), %d Info+ log lines (want one attempt per period and one warning)", attempts, n, len(said))
	}
}

// Reloading with `direct_sockets off` while an agent's session runs: its
// later bulk connections stay on the lane, and it is not reconnected.
func TestReloadTurningDirectSocketsOffReachesRunningSessions(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a := launchAgent(t, c.serverURL(), "reload-direct", testToken, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	sessions := a.Sessions()
	c.opts.Sluice = "direct_sockets off"
	reloadWithNewSite(t, c, siteAll)
	checkDownload(t, c, "app.test", 16<<20)
	if a.Sessions() != sessions {
		t.Fatalf("reload reconnected the agent")
	}
	if n := a.Stats().Direct; n != 0 {
		t.Fatalf("after a reload with direct_sockets off, the running session still opened %d direct socket(s)", n)
	}
}

// barrierUpstream answers /burst once n requests arrived, each with size bytes.
func barrierUpstream(t testing.TB, n int, size int) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	arrived := 0
	gate := make(chan struct{})
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		mu.Lock()
		arrived++
		if arrived == n {
			close(gate)
		}
		mu.Unlock()
		<-gate
		w.Header().Set("Content-Length", fmt.Sprint(size))
		buf := make([]byte, 256<<10)
		for left := size; left > 0; left -= len(buf) {
			w.Write(buf[:min(left, len(buf))])
		}
	})}
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

func burst(t *testing.T, pendingPerAddr string, n int) {
	tn := newTLSNode(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option(pendingPerAddr), CaptureLog: true}, siteAll)
	up := barrierUpstream(t, n, 4<<20)
	serverURL := grpcsURL(c)
	a, _ := launchAgentLogged(t, serverURL, "burst", testToken, tn.trust,
		false, agent.Upstream{Host: "app.test", Target: up})
	waitConnected(t, a)
	var wg sync.WaitGroup
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{MaxIdleConnsPerHost: n}}
	for range n {
		wg.Add(1)
		go func() {
			defer wg.Done()
			req, _ := http.NewRequest("GET", c.url("/burst"), nil)
			req.Host = "app.test"
			resp, err := client.Do(req)
			if err != nil {
				t.Error(err)
				return
			}
			m, err := io.Copy(io.Discard, resp.Body)
			resp.Body.Close()
			if err != nil || m != 4<<20 {
				t.Errorf("burst download: %d bytes, %v", m, err)
			}
		}()
	}
	wg.Wait()
	refused := c.logLines(t, "control connection refused: too many connections have not presented the token")
	t.Logf("direct sockets: %d of %d; guard refusals logged: %d", a.Stats().Direct, n, len(refused))
	if len(refused) > 0 || a.Stats().Direct == 0 {
		t.Fatalf("direct sockets of an authenticated agent were refused by the unproven-connection guard: %d of %d went direct; %d refusal line(s), first: %s",
			a.Stats().Direct, n, len(refused), firstLine(refused))
	}
}

func TestDirectBurstPendingLimit4(t *testing.T)  { burst(t, "max_pending_streams_per_address 4", 12) }
func TestDirectBurstPendingDefault(t *testing.T) { burst(t, "", 40) }

// Half-close in both directions on direct sockets over a TLS control plane.
func TestDirectHalfCloseOverTLS(t *testing.T) {
	tn := newTLSNode(t)
	count := serveTCP(t, countHandler)
	reports := make(chan string, 4)
	const size = 4 << 20
	first := serveTCP(t, halfCloseFirstHandler(make([]byte, size), reports))
	pCount, pFirst := freePort(t), freePort(t)
	c := startCaddyWith(t, caddyOptions{Sluice: tn.option(),
		Global: portRangeGlobal(min(pCount, pFirst), max(pCount, pFirst))}, "")
	serverURL := grpcsURL(c)
	a, _ := launchAgentLogged(t, serverURL, "tls-hc", testToken, tn.trust, false,
		agent.Upstream{ListenPort: pCount, Target: tcpTarget(count)},
		agent.Upstream{ListenPort: pFirst, Target: tcpTarget(first)})
	waitConnected(t, a)
	eventually(t, 5*time.Second, "ports bound", func() bool { return !portFree(loopback(pCount)) && !portFree(loopback(pFirst)) })
	data := make([]byte, size)
	for i := range data {
		data[i] = byte(i * 7)
	}
	t.Run("client half-closes", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", loopback(pCount), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write(data); err != nil {
			t.Fatal(err)
		}
		conn.(*net.TCPConn).CloseWrite()
		got, err := readAllWithin(conn, 10*time.Second)
		if err != nil || string(got) != digest(data)+"\n" {
			t.Fatalf("response %q, err %v", got, err)
		}
	})
	t.Run("upstream half-closes", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", loopback(pFirst), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		got, err := readAllWithin(conn, 10*time.Second)
		if err != nil || len(got) != size {
			t.Fatalf("read %d bytes, %v; want %d then EOF", len(got), err, size)
		}
		conn.SetWriteDeadline(time.Now().Add(10 * time.Second))
		if _, err := conn.Write(data); err != nil {
			t.Fatalf("write after EOF: %v", err)
		}
		conn.(*net.TCPConn).CloseWrite()
		select {
		case r := <-reports:
			if r != digest(data) {
				t.Fatalf("upstream got %s", r)
			}
		case <-time.After(10 * time.Second):
			t.Fatal("no report")
		}
	})
	t.Logf("direct sockets: %d", a.Stats().Direct)
	if a.Stats().Direct < 2 {
		t.Errorf("want both connections direct, got %d", a.Stats().Direct)
	}
}

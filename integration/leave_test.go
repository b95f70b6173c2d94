package integration

import (
	"bufio"
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os/exec"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

// TestAgentLeaves: a sluice-agent process told to stop (SIGTERM) leaves
// gracefully. The node routes it nothing new, so requests move to the other
// agent serving the host without one failing; what it has open finishes;
// then it exits by itself, without waiting out its grace. The grace bounds
// the wait, and a second signal ends it at once.
func TestAgentLeaves(t *testing.T) {
	bin := buildAgent(t)

	t.Run("requests move to the other agent and the open ones finish", func(t *testing.T) {
		c := startCaddy(t, siteAll)
		a := startLeavingAgent(t, c, bin, "60s")
		startAgent(t, c.serverURL(), "agent-b", agent.Upstream{Host: "app.test", Target: startUpstream(t, "b")})
		const size = 64 << 20
		dl := startDownload(t, c, size)
		// agent-a serves first (agent ids in order), and this request, made
		// while the download holds the first connection, leaves a second,
		// idle one to it in Caddy's pool.
		if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from a") {
			t.Fatalf("before: %d %q", code, body)
		}
		a.signal(t, syscall.SIGTERM)
		eventually(t, 10*time.Second, "new requests go to agent-b", func() bool {
			code, body := get(t, c, "app.test", "/")
			if code != 200 {
				t.Fatalf("a request failed while agent-a was leaving: %d %q", code, body)
			}
			return strings.Contains(body, "Hello from b")
		})
		if a.exited() {
			t.Fatalf("agent-a exited with a download open:\n%s", a.out.String())
		}
		dl.finish(t, size)

		// Its grace is 60 s: exiting well before that means nothing held it,
		// the idle pooled connections included.
		a.wait(t, 20*time.Second)
		a.mustLog(t, "left the node: every connection finished")
		if code, body := get(t, c, "app.test", "/"); code != 200 || !strings.Contains(body, "Hello from b") {
			t.Fatalf("after agent-a left: %d %q", code, body)
		}
	})

	t.Run("idle pooled connections do not hold it", func(t *testing.T) {
		c := startCaddy(t, siteAll)
		a := startLeavingAgent(t, c, bin, "60s") // its GETs leave idle connections in Caddy's pool
		a.signal(t, syscall.SIGTERM)
		a.wait(t, 20*time.Second)
		a.mustLog(t, "left the node: every connection finished")
		if code, _ := get(t, c, "app.test", "/"); code != http.StatusServiceUnavailable {
			t.Fatalf("after the only agent left: %d, want 503", code)
		}
	})

	t.Run("HTTP/2 upstream connections do not hold it", func(t *testing.T) {
		c := startCaddy(t, `http://:{HTTP} {
	sluice {
		transport sluice {
			versions h2c
		}
	}
}`)
		a := startLeavingAgent(t, c, bin, "60s")
		const size = 16 << 20
		dl := startDownload(t, c, size)
		a.signal(t, syscall.SIGTERM)
		eventually(t, 10*time.Second, "agent-a is leaving", func() bool { return a.logged("leaving the node") })
		dl.finish(t, size)
		// The upstream connection, an h2c one, went idle with the download.
		a.wait(t, 20*time.Second)
		a.mustLog(t, "left the node: every connection finished")
	})

	t.Run("a WebSocket runs on until it closes", func(t *testing.T) {
		c := startCaddy(t, siteAll)
		a := startLeavingAgent(t, c, bin, "60s") // its GETs leave idle pooled connections too
		ws := dialWS(t, c, "app.test")
		defer ws.CloseNow()
		echoWS(t, ws, 10)
		a.signal(t, syscall.SIGTERM)
		eventually(t, 10*time.Second, "agent-a's routes withdrawn", func() bool {
			code, _ := get(t, c, "app.test", "/")
			return code == http.StatusServiceUnavailable
		})
		// The node closes the idle pooled connections at once and then
		// once a second: the WebSocket's must survive two of its sweeps.
		for end := time.Now().Add(2500 * time.Millisecond); time.Now().Before(end); {
			echoWS(t, ws, 10)
		}
		if a.exited() {
			t.Fatalf("agent-a exited with a WebSocket open:\n%s", a.out.String())
		}
		ws.Close(websocket.StatusNormalClosure, "")
		a.wait(t, 20*time.Second)
		a.mustLog(t, "left the node: every connection finished")
	})

	t.Run("a claimed port passes to the other agent and its open connection finishes", func(t *testing.T) {
		port := freePort(t)
		c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(port, port)}, "")
		addr := loopback(port)
		a := startAgentProcess(t, bin, "-server", c.serverURL(), "-token", testToken, "-id", "agent-a",
			"-shutdown-grace", "60s", "-upstream", fmt.Sprintf("listen_port=%d,target=%s", port, tcpTarget(serveTCP(t, greetEchoHandler("a")))))
		eventually(t, 10*time.Second, "agent-a serves the port", func() bool { g, _ := greeting(addr); return g == "a" })
		startAgent(t, c.serverURL(), "agent-b", agent.Upstream{ListenPort: port, Target: tcpTarget(serveTCP(t, greetEchoHandler("b")))})

		open, err := net.DialTimeout("tcp", addr, 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer open.Close()
		open.SetDeadline(time.Now().Add(30 * time.Second))
		r := bufio.NewReader(open)
		if line, err := r.ReadString('\n'); err != nil || line != "a\n" {
			t.Fatalf("greeting %q %v", line, err)
		}
		a.signal(t, syscall.SIGTERM)
		eventually(t, 10*time.Second, "new connections reach agent-b", func() bool { g, _ := greeting(addr); return g == "b" })
		if _, err := open.Write([]byte("still here")); err != nil {
			t.Fatal(err)
		}
		open.(*net.TCPConn).CloseWrite()
		if rest, err := io.ReadAll(r); err != nil || string(rest) != "still here" {
			t.Fatalf("the open connection through agent-a: %q %v", rest, err)
		}
		a.wait(t, 20*time.Second)
		a.mustLog(t, "left the node: every connection finished")
	})

	t.Run("the grace cuts what is left", func(t *testing.T) {
		c := startCaddy(t, siteAll)
		a := startLeavingAgent(t, c, bin, "1s")
		dl := startDownload(t, c, 1<<30) // read no further: it cannot finish
		a.signal(t, syscall.SIGTERM)
		a.wait(t, 15*time.Second)
		a.mustLog(t, "shutdown grace over")
		dl.mustBreak(t)
	})

	t.Run("a second signal cuts at once", func(t *testing.T) {
		c := startCaddy(t, siteAll)
		a := startLeavingAgent(t, c, bin, "10m")
		dl := startDownload(t, c, 1<<30)
		a.signal(t, syscall.SIGTERM)
		eventually(t, 10*time.Second, "agent-a is leaving", func() bool { return a.logged("leaving the node") })
		a.signal(t, syscall.SIGINT)
		a.wait(t, 15*time.Second)
		a.mustLog(t, "second signal")
		a.mustLog(t, "told to stop now")
		dl.mustBreak(t)
	})
}

// startLeavingAgent runs the sluice-agent binary as agent-a, serving
// app.test from an upstream named "a", with the given shutdown grace, and
// waits until app.test is served.
func startLeavingAgent(t *testing.T, c *caddyServer, bin, grace string) *agentProcess {
	t.Helper()
	p := startAgentProcess(t, bin, "-server", c.serverURL(), "-token", testToken, "-id", "agent-a",
		"-shutdown-grace", grace, "-upstream", "host=app.test,target="+startUpstream(t, "a"))
	eventually(t, 10*time.Second, "agent-a serves app.test", func() bool {
		code, _ := get(t, c, "app.test", "/")
		return code == 200
	})
	return p
}

// agentProcess is a running sluice-agent binary.
type agentProcess struct {
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
	err  error // the exit status, once done is closed
}

func startAgentProcess(t *testing.T, bin string, args ...string) *agentProcess {
	t.Helper()
	p := &agentProcess{cmd: exec.Command(bin, args...), out: new(syncBuffer), done: make(chan struct{})}
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { p.err = p.cmd.Wait(); close(p.done) }()
	t.Cleanup(func() {
		if !p.exited() {
			p.cmd.Process.Kill()
			<-p.done
		}
		if t.Failed() {
			t.Logf("sluice-agent output:\n%s", p.out.String())
		}
	})
	return p
}

func (p *agentProcess) signal(t *testing.T, sig syscall.Signal) {
	t.Helper()
	if err := p.cmd.Process.Signal(sig); err != nil {
		t.Fatal(err)
	}
}

func (p *agentProcess) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// wait waits (bounded) for the process to exit, and requires status 0.
func (p *agentProcess) wait(t *testing.T, within time.Duration) {
	t.Helper()
	select {
	case <-p.done:
	case <-time.After(within):
		t.Fatalf("sluice-agent still running %v later", within)
	}
	if p.err != nil {
		t.Fatalf("sluice-agent exited with %v", p.err)
	}
}

func (p *agentProcess) logged(s string) bool { return strings.Contains(p.out.String(), s) }

func (p *agentProcess) mustLog(t *testing.T, s string) {
	t.Helper()
	if !p.logged(s) {
		t.Fatalf("sluice-agent did not log %q", s)
	}
}

// syncBuffer is a bytes.Buffer a process writes while the test reads it.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (b *syncBuffer) Write(p []byte) (int, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.Write(p)
}

func (b *syncBuffer) String() string {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.b.String()
}

// download is a /download through Caddy whose first MiB was read.
type download struct {
	resp *http.Response
	hash io.Writer
	sum  func() []byte
}

func startDownload(t *testing.T, c *caddyServer, size int64) *download {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url(fmt.Sprintf("/download?size=%d", size)), nil)
	req.Host = "app.test"
	resp, err := hostClient().Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		t.Fatalf("download: status %d", resp.StatusCode)
	}
	h := sha256.New()
	if _, err := io.CopyN(h, resp.Body, 1<<20); err != nil {
		t.Fatalf("download: first MiB: %v", err)
	}
	return &download{resp: resp, hash: h, sum: func() []byte { return h.Sum(nil) }}
}

// finish reads the rest and checks the whole body.
func (d *download) finish(t *testing.T, size int64) {
	t.Helper()
	n, err := io.Copy(d.hash, d.resp.Body)
	if err != nil || n+1<<20 != size {
		t.Fatalf("download: %d of %d bytes, %v", n+1<<20, size, err)
	}
	want := sha256.New()
	io.Copy(want, sampleupstream.Pattern(size))
	if !bytes.Equal(d.sum(), want.Sum(nil)) {
		t.Fatal("download: the body differs from the upstream's")
	}
}

// mustBreak reads the rest, which must end in an error: the download was cut.
func (d *download) mustBreak(t *testing.T) {
	t.Helper()
	n, err := io.Copy(io.Discard, d.resp.Body)
	if err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("download read to its end (%d more bytes) instead of breaking", n)
	}
}

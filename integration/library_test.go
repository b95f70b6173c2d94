package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/coder/websocket"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/internal/testwait"
)

// libraryHandler is the program's own application: a greeting that tells
// the host and the client address it saw, and a WebSocket echo.
func libraryHandler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/hello", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the program: host=%s remote=%s", r.Host, r.RemoteAddr)
	})
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		for {
			typ, msg, err := c.Read(r.Context())
			if err != nil {
				return
			}
			if err := c.Write(r.Context(), typ, msg); err != nil {
				return
			}
		}
	})
	return mux
}

// TestLibraryListener: a program serves its own http.Server on
// agent.Listen's listener, with no local port, and a real Caddy routes
// requests and a WebSocket for the host to it through the tunnel. Closing
// the listener withdraws the route (503) while the WebSocket accepted
// before keeps working, and the agent stops once it is closed.
func TestLibraryListener(t *testing.T) {
	c := startCaddy(t, siteAll)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := &agent.Config{Server: c.serverURL(), Token: testToken, ID: "agent-library"}
	l, err := agent.Listen(ctx, cfg, agent.Upstream{Host: "lib.test"},
		agent.WithLogger(zaptest.NewLogger(t, zaptest.Level(zap.WarnLevel)).Named("agent-library")),
		agent.WithBackoff(50*time.Millisecond, 500*time.Millisecond))
	if err != nil {
		t.Fatal(err)
	}
	if got := l.Addr().String(); got != "lib.test" {
		t.Errorf("Addr %q, want lib.test", got)
	}
	srv := &http.Server{Handler: libraryHandler(), ReadHeaderTimeout: 10 * time.Second}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(l) }()
	t.Cleanup(func() {
		srv.Close()
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		l.Shutdown(sctx)
	})

	t.Run("requests", func(t *testing.T) {
		code, body := get(t, c, "lib.test", "/hello")
		if code != http.StatusOK || !strings.HasPrefix(body, "hello from the program: host=lib.test remote=127.0.0.1:") {
			t.Fatalf("GET /hello: %d %q", code, body)
		}
		// Concurrent requests each take a connection of their own.
		var wg sync.WaitGroup
		errs := make(chan string, 16)
		for i := range 16 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				code, body := get(t, c, "lib.test", fmt.Sprintf("/hello?i=%d", i))
				if code != http.StatusOK || !strings.Contains(body, "host=lib.test") {
					errs <- fmt.Sprintf("request %d: %d %q", i, code, body)
				}
			}()
		}
		wg.Wait()
		close(errs)
		for e := range errs {
			t.Error(e)
		}
	})

	ws := dialWS(t, c, "lib.test")
	defer ws.CloseNow()
	echoWS(t, ws, 100)

	if err := l.Close(); err != nil {
		t.Fatal(err)
	}
	testwait.Until(t, 10*time.Second, "503 for lib.test once the listener is closed", func() bool {
		code, _ := get(t, c, "lib.test", "/hello")
		return code == http.StatusServiceUnavailable
	})
	select {
	case err := <-served:
		if !errors.Is(err, net.ErrClosed) {
			t.Errorf("Serve returned %v, want net.ErrClosed", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("Serve did not return after the listener closed")
	}
	// The WebSocket accepted before Close is the program's until it
	// closes it; the agent leaves once it is closed.
	echoWS(t, ws, 10)
	select {
	case <-l.Done():
		t.Fatal("the agent stopped while the WebSocket was open")
	default:
	}
	ws.Close(websocket.StatusNormalClosure, "")
	select {
	case <-l.Done():
	case <-time.After(15 * time.Second):
		t.Fatalf("the agent did not stop once the WebSocket closed: %+v", l.Agent().Stats())
	}
}

// TestLibraryListenerRejected: a route the node cannot serve fails Listen
// with the node's reason, as a taken port fails net.Listen.
func TestLibraryListenerRejected(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\ttcp_port_range 16000-16001\n\t\ttcp_bind 127.0.0.1"}, siteAll)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	cfg := &agent.Config{Server: c.serverURL(), Token: testToken, ID: "agent-library"}
	l, err := agent.Listen(ctx, cfg, agent.Upstream{ListenPort: 17000, Target: "tcp://"},
		agent.WithLogger(zaptest.NewLogger(t, zaptest.Level(zap.ErrorLevel))))
	if err == nil {
		l.Close()
		t.Fatal("Listen succeeded for a port outside the node's tcp_port_range")
	}
	if !strings.Contains(err.Error(), "rejected route :17000") {
		t.Errorf("error %q does not name the route", err)
	}
}

// TestLibraryExampleProgram: examples/listen, built and run as a program
// against a real Caddy, serves its greeting and WebSocket for its host
// through the tunnel, and withdraws the host when it stops on SIGTERM.
func TestLibraryExampleProgram(t *testing.T) {
	c := startCaddy(t, siteAll)
	bin := filepath.Join(t.TempDir(), "listen-example")
	if out, err := exec.Command("go", "build", "-o", bin, "../examples/listen").CombinedOutput(); err != nil {
		t.Fatalf("building examples/listen: %v\n%s", err, out)
	}
	var out bytes.Buffer
	cmd := exec.Command(bin, "-host", "example.test")
	cmd.Env = append(os.Environ(), agent.EnvServer+"="+c.serverURL(), agent.EnvToken+"="+testToken, agent.EnvID+"=agent-example")
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		select {
		case <-exited:
		default:
			cmd.Process.Kill()
			<-exited
		}
		if t.Failed() {
			t.Logf("example output:\n%s", out.String())
		}
	})

	testwait.Until(t, 30*time.Second, "the example's greeting through the tunnel", func() bool {
		code, body := get(t, c, "example.test", "/")
		return code == http.StatusOK && strings.Contains(body, "from a program with no open port")
	})
	ws := dialWS(t, c, "example.test")
	echoWS(t, ws, 10)
	ws.Close(websocket.StatusNormalClosure, "")

	if err := cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-exited:
		exited <- err // for the cleanup
		if err != nil {
			t.Errorf("the example exited with %v", err)
		}
	case <-time.After(20 * time.Second):
		t.Fatal("the example did not exit within 20s of SIGTERM")
	}
	if code, _ := get(t, c, "example.test", "/"); code != http.StatusServiceUnavailable {
		t.Errorf("after the example stopped: %d, want 503", code)
	}
}

package integration

import (
	"fmt"
	"io"
	"net"
	"net/http"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
)

// headDeadline is the response_header_timeout of the deadline tests: short,
// so a hung upstream is answered soon.
const headDeadline = time.Second

// deadlineSites serve every host with response_header_timeout
// headDeadline (hung-h2c.test speaking h2c to its upstream), /poll being a
// stream from the start.
const deadlineSites = `http://hung-h2c.test:{HTTP} {
	sluice {
		response_header_timeout 1s
		transport sluice {
			versions h2c
		}
	}
}

http://:{HTTP} {
	sluice {
		response_header_timeout 1s
		stream_path_prefixes /poll
	}
}`

// hungUpstream accepts connections and reads what they send, but never
// answers; it counts the connections that ended.
type hungUpstream struct {
	url    string
	ended  atomic.Int32
	opened atomic.Int32
}

func startHungUpstream(t testing.TB) *hungUpstream {
	t.Helper()
	h := &hungUpstream{}
	port := serveTCP(t, func(c net.Conn) {
		h.opened.Add(1)
		io.Copy(io.Discard, c) // until the tunnel closes the connection
		h.ended.Add(1)
	})
	h.url = "http://" + loopback(port)
	return h
}

// startDeadlineApp serves the answering side of the deadline tests:
//
//	/slow?delay=   answers after delay
//	/sse           an event stream: event 1 at once, event 2 when release closes
//	/poll?delay=   a long poll whose head comes after delay
//	/upload        answers the size of the request body
func startDeadlineApp(t testing.TB, release <-chan struct{}) string {
	t.Helper()
	mux := http.NewServeMux()
	wait := func(r *http.Request) bool {
		d, err := time.ParseDuration(r.URL.Query().Get("delay"))
		if err != nil {
			return true
		}
		select {
		case <-time.After(d):
			return true
		case <-r.Context().Done():
			return false
		}
	}
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		if wait(r) {
			fmt.Fprintln(w, "slow answer")
		}
	})
	mux.HandleFunc("/poll", func(w http.ResponseWriter, r *http.Request) {
		if wait(r) {
			fmt.Fprintln(w, "poll answer")
		}
	})
	mux.HandleFunc("/upload", func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(io.Discard, r.Body)
		if err != nil {
			http.Error(w, err.Error(), http.StatusBadRequest)
			return
		}
		fmt.Fprintf(w, "%d\n", n)
	})
	mux.HandleFunc("/sse", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		serveTwoEvents(w, r, release)
	})
	return serveUpstream(t, mux)
}

// TestResponseHeaderTimeout: an upstream that accepts and never answers is
// answered 504 once response_header_timeout passes, over HTTP/1.1 and h2c
// to the upstream, and its connection is closed; a slow answer under the
// deadline, an event stream longer than it, a long poll of a
// stream_path_prefixes path, a gRPC call whose head comes after it and an
// upload that waits on the client longer than it are not cut.
func TestResponseHeaderTimeout(t *testing.T) {
	c := startCaddy(t, deadlineSites)
	hung, hungH2C := startHungUpstream(t), startHungUpstream(t)
	release := make(chan struct{})
	app := startDeadlineApp(t, release)
	startAgent(t, c.serverURL(), "agent-deadline",
		agent.Upstream{Host: "hung.test", Target: hung.url},
		agent.Upstream{Host: "hung-h2c.test", Target: hungH2C.url},
		agent.Upstream{Host: "app.test", Target: app})
	client := &http.Client{Timeout: 30 * time.Second}

	for _, tc := range []struct {
		host string
		up   *hungUpstream
		h1   bool // HTTP/1.1 to the upstream: the connection ends with the exchange
	}{{"hung.test", hung, true}, {"hung-h2c.test", hungH2C, false}} {
		t.Run("hung upstream "+tc.host, func(t *testing.T) {
			req, _ := http.NewRequest("GET", c.url("/never"), nil)
			req.Host = tc.host
			start := time.Now()
			resp, err := client.Do(req)
			if err != nil {
				t.Fatalf("GET: %v", err)
			}
			resp.Body.Close()
			if resp.StatusCode != http.StatusGatewayTimeout {
				t.Fatalf("status %d, want 504", resp.StatusCode)
			}
			if waited := time.Since(start); waited < headDeadline {
				t.Fatalf("504 after %v, before the deadline of %v", waited, headDeadline)
			}
			if tc.up.opened.Load() == 0 {
				t.Fatal("the request never reached the hung upstream")
			}
			if !tc.h1 {
				// Over h2c the exchange ends with its stream (a
				// RST_STREAM); the connection stays pooled.
				return
			}
			// The parked exchange is freed: the agent closes its upstream
			// connection when the tunnel's virtual connection ends.
			eventually(t, 10*time.Second, "the hung upstream's connection closed", func() bool {
				return tc.up.ended.Load() >= tc.up.opened.Load()
			})
		})
	}

	t.Run("slow answer under the deadline", func(t *testing.T) {
		if code, body := deadlineGet(t, client, c, "app.test", "/slow?delay=300ms"); code != 200 || body != "slow answer\n" {
			t.Fatalf("%d %q, want 200", code, body)
		}
	})

	t.Run("long poll of a stream path", func(t *testing.T) {
		delay := 2 * headDeadline
		if code, body := deadlineGet(t, client, c, "app.test", "/poll?delay="+delay.String()); code != 200 || body != "poll answer\n" {
			t.Fatalf("%d %q, want 200: stream_path_prefixes are exempt", code, body)
		}
	})

	t.Run("gRPC call holding its head back", func(t *testing.T) {
		// A server-streaming gRPC call may send its head with its
		// first message, long after the deadline: gRPC calls are
		// exempt (they carry grpc-timeout).
		req, _ := http.NewRequest("POST", c.url("/slow?delay="+(2*headDeadline).String()), strings.NewReader("\x00\x00\x00\x00\x00"))
		req.Host = "app.test"
		req.Header.Set("Content-Type", "application/grpc+proto")
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("POST: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || string(b) != "slow answer\n" {
			t.Fatalf("%d %q, want 200: a gRPC call is not cut by response_header_timeout", resp.StatusCode, b)
		}
	})

	t.Run("event stream longer than the deadline", func(t *testing.T) {
		s := openSSE(t, h1Client(), sseRequest(t, c.url("/sse"), "app.test", true))
		if s.resp.StatusCode != 200 {
			t.Fatalf("status %d", s.resp.StatusCode)
		}
		if ev := s.mustNext(t, 10*time.Second); ev != "id: 1\ndata: one" {
			t.Fatalf("first event %q", ev)
		}
		// The stream stays open, silent, well past the deadline.
		if ev, err := s.next(3 * headDeadline); err == nil || strings.Contains(err.Error(), "EOF") {
			t.Fatalf("while silent: event %q, err %v; the stream must stay open", ev, err)
		}
		close(release)
		if ev := s.mustNext(t, 10*time.Second); ev != "id: 2\ndata: two" {
			t.Fatalf("second event %q", ev)
		}
		if n, ended, err := s.end(10 * time.Second); !ended || err != nil || n != 0 {
			t.Fatalf("stream end: ended %v, err %v, %d extra events", ended, err, n)
		}
	})

	t.Run("upload waiting on the client", func(t *testing.T) {
		pr, pw := io.Pipe()
		go func() {
			pw.Write([]byte(strings.Repeat("a", 1000)))
			// The client pauses longer than the deadline (the
			// scenario, not a wait for something to settle): waiting
			// for the client's body is not the upstream's delay.
			<-time.After(2 * headDeadline)
			pw.Write([]byte(strings.Repeat("b", 1000)))
			pw.Close()
		}()
		req, _ := http.NewRequest("POST", c.url("/upload"), pr)
		req.Host = "app.test"
		resp, err := client.Do(req)
		if err != nil {
			t.Fatalf("POST: %v", err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != 200 || string(b) != "2000\n" {
			t.Fatalf("%d %q, want 200 2000", resp.StatusCode, b)
		}
	})
}

// deadlineGet is get through client.
func deadlineGet(t testing.TB, client *http.Client, c *caddyServer, host, path string) (int, string) {
	t.Helper()
	req, _ := http.NewRequest("GET", c.url(path), nil)
	req.Host = host
	resp, err := client.Do(req)
	if err != nil {
		t.Fatalf("GET %s%s: %v", host, path, err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

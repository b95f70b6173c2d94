package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"fmt"
	"io"
	"math/rand/v2"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/quic-go/quic-go"
	"github.com/quic-go/quic-go/http3"

	"github.com/sluice-tunnel/sluice/agent"
)

// h3DownloadSize is the download the HTTP/3 test checks end to end.
const h3DownloadSize = 32 << 20

// h3Events is how many events the HTTP/3 test's event stream sends.
const h3Events = 3

// h3Upstream is the private application behind the tunnel in the HTTP/3
// test: /blob is a 32 MiB download of pseudo-random bytes, /events an
// event stream that sends event k+1 only once the test released event k
// (so an event read before its release proves the stream is not
// buffered to its end anywhere on the way).
type h3Upstream struct {
	url     string
	blob    []byte
	release [h3Events]chan struct{}
}

func startH3Upstream(t *testing.T) *h3Upstream {
	t.Helper()
	u := &h3Upstream{blob: make([]byte, h3DownloadSize)}
	rng := rand.NewChaCha8([32]byte{'h', '3'})
	_, _ = rng.Read(u.blob) // never fails
	for i := range u.release {
		u.release[i] = make(chan struct{})
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/blob", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "application/octet-stream")
		http.ServeContent(w, r, "blob", time.Time{}, bytes.NewReader(u.blob))
	})
	mux.HandleFunc("/events", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/event-stream")
		w.Header().Set("Cache-Control", "no-cache")
		rc := http.NewResponseController(w)
		for k := range h3Events {
			fmt.Fprintf(w, "id: %d\ndata: event-%d\n\n", k+1, k+1)
			if rc.Flush() != nil {
				return
			}
			select {
			case <-u.release[k]:
			case <-r.Context().Done():
				return
			case <-time.After(30 * time.Second): // the test failed: end the stream
				return
			}
		}
	})
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "h3 upstream: host=%s\n", r.Host)
	})
	u.url = serveUpstream(t, mux)
	return u
}

// TestHTTP3ThroughTunnel: Caddy serves HTTP/3 on a TLS site (tls
// internal), and a host tunneled by the sluice directive answers over it
// like over HTTP/1.1 and HTTP/2: a Go client speaking only HTTP/3 (QUIC
// over UDP to the HTTPS port) fetches a 32 MiB download intact and reads
// an event stream event by event.
func TestHTTP3ThroughTunnel(t *testing.T) {
	c := startCaddy(t, `h3.test {
	tls internal
	sluice
}`)
	up := startH3Upstream(t)
	startAgent(t, c.serverURL(), "agent-h3", agent.Upstream{Host: "h3.test", Target: up.url})

	// Caddy makes its local CA as it starts the site's certificate: wait
	// for the root, then trust it alone.
	rootPath := filepath.Join(c.storage, "pki", "authorities", "local", "root.crt")
	eventually(t, 15*time.Second, "the local CA's root", func() bool {
		_, err := os.Stat(rootPath)
		return err == nil
	})
	roots := localCARoots(t, c)
	addr := fmt.Sprintf("127.0.0.1:%d", c.httpsPort)
	tr := &http3.Transport{
		TLSClientConfig: &tls.Config{ServerName: "h3.test", RootCAs: roots},
		// The URL names the site; the node listens on loopback (UDP, on
		// the HTTPS port as Caddy binds it for HTTP/3).
		Dial: func(ctx context.Context, _ string, tlsCfg *tls.Config, qc *quic.Config) (*quic.Conn, error) {
			return quic.DialAddrEarly(ctx, addr, tlsCfg, qc)
		},
	}
	t.Cleanup(func() { tr.Close() })
	client := &http.Client{Transport: tr}
	get := func(ctx context.Context, path string) (*http.Response, error) {
		req, err := http.NewRequestWithContext(ctx, http.MethodGet, "https://h3.test"+path, nil)
		if err != nil {
			return nil, err
		}
		return client.Do(req)
	}

	// The site's certificate is issued just after start.
	var lastErr error
	defer func() {
		if t.Failed() {
			t.Logf("the last HTTP/3 attempt: %v", lastErr)
		}
	}()
	eventually(t, 20*time.Second, "an HTTP/3 answer from the tunneled host", func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		resp, err := get(ctx, "/")
		if err != nil {
			lastErr = err
			return false
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		lastErr = fmt.Errorf("%d %s %q: %v", resp.StatusCode, resp.Proto, body, err)
		return err == nil && resp.StatusCode == http.StatusOK && resp.Proto == "HTTP/3.0" &&
			strings.Contains(string(body), "h3 upstream: host=h3.test")
	})

	// Browsers find HTTP/3 through the Alt-Svc header of an HTTP/1.1 or
	// HTTP/2 answer: Caddy adds it to the tunneled host's answers too.
	t.Run("alt-svc over h2", func(t *testing.T) {
		h2 := &http.Transport{
			TLSClientConfig:   &tls.Config{ServerName: "h3.test", RootCAs: roots},
			ForceAttemptHTTP2: true,
			DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
				return (&net.Dialer{}).DialContext(ctx, network, addr)
			},
		}
		defer h2.CloseIdleConnections()
		resp, err := (&http.Client{Transport: h2, Timeout: 10 * time.Second}).Get("https://h3.test/")
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if want := fmt.Sprintf(`h3=":%d"`, c.httpsPort); resp.Proto != "HTTP/2.0" || !strings.Contains(resp.Header.Get("Alt-Svc"), want) {
			t.Fatalf("%s answer with Alt-Svc %q: want HTTP/2.0 and %s", resp.Proto, resp.Header.Get("Alt-Svc"), want)
		}
	})

	t.Run("download", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		resp, err := get(ctx, "/blob")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Proto != "HTTP/3.0" {
			t.Fatalf("status %d, proto %s", resp.StatusCode, resp.Proto)
		}
		h := sha256.New()
		n, err := io.Copy(h, resp.Body)
		if err != nil {
			t.Fatalf("after %d bytes: %v", n, err)
		}
		if want := sha256.Sum256(up.blob); n != h3DownloadSize || !bytes.Equal(h.Sum(nil), want[:]) {
			t.Fatalf("got %d bytes with sha256 %x, want %d with %x", n, h.Sum(nil), h3DownloadSize, want)
		}
	})

	t.Run("event stream", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		resp, err := get(ctx, "/events")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		if resp.StatusCode != http.StatusOK || resp.Proto != "HTTP/3.0" {
			t.Fatalf("status %d, proto %s", resp.StatusCode, resp.Proto)
		}
		if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
			t.Fatalf("Content-Type %q", ct)
		}
		br := bufio.NewReader(resp.Body)
		for k := range h3Events {
			// The upstream holds event k+2 (and the stream's end) until
			// event k+1 is released: reading it now shows it came alone.
			ev, err := readEvent(br)
			if err != nil {
				t.Fatalf("event %d: %v", k+1, err)
			}
			if want := fmt.Sprintf("id: %d\ndata: event-%d\n", k+1, k+1); ev != want {
				t.Fatalf("event %d: got %q, want %q", k+1, ev, want)
			}
			close(up.release[k])
		}
		if rest, err := io.ReadAll(br); err != nil || len(rest) != 0 {
			t.Fatalf("after the last event: %q, %v (want the stream's clean end)", rest, err)
		}
	})
}

// readEvent reads one server-sent event: its lines up to the blank line
// that ends it (which it leaves out).
func readEvent(br *bufio.Reader) (string, error) {
	var ev strings.Builder
	for range 100 { // an event of this test has two lines
		line, err := br.ReadString('\n')
		if err != nil {
			return ev.String(), fmt.Errorf("after %q: %w", ev.String(), err)
		}
		if line == "\n" {
			return ev.String(), nil
		}
		ev.WriteString(line)
	}
	return ev.String(), fmt.Errorf("no end of event after 100 lines: %q", ev.String())
}

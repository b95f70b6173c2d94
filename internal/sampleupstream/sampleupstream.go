// Package sampleupstream is the small web application the demo and the
// integration tests put behind an agent: plain pages, uploads and downloads
// of any size with checksums, a WebSocket echo and a server-sent event
// stream. It speaks HTTP/1.1 and h2c on one port.
package sampleupstream

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"strconv"
	"time"

	"github.com/coder/websocket"
)

// Handler returns the application; name appears in every greeting so tests
// can tell upstreams apart.
func Handler(name string) http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintf(w, "Hello from %s: host=%s proto=%s path=%s\n", name, r.Host, r.Proto, r.URL.Path)
	})
	mux.HandleFunc("/headers", func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintf(w, "Host: %s\n", r.Host)
		for _, h := range []string{"X-Forwarded-For", "X-Forwarded-Proto", "X-Forwarded-Host"} {
			fmt.Fprintf(w, "%s: %s\n", h, r.Header.Get(h))
		}
	})
	mux.HandleFunc("/upload", upload)
	mux.HandleFunc("/download", download)
	mux.HandleFunc("/ws", wsEcho)
	mux.HandleFunc("/sse", sse)
	return mux
}

// Server returns an http.Server for h serving HTTP/1.1 and h2c.
func Server(h http.Handler) *http.Server {
	s := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	s.Protocols = new(http.Protocols)
	s.Protocols.SetHTTP1(true)
	s.Protocols.SetUnencryptedHTTP2(true)
	return s
}

// upload answers with the size and SHA-256 of the request body.
func upload(w http.ResponseWriter, r *http.Request) {
	h := sha256.New()
	n, err := io.Copy(h, r.Body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	fmt.Fprintf(w, "%d %s\n", n, hex.EncodeToString(h.Sum(nil)))
}

// Pattern returns the deterministic content of a /download of size bytes:
// a pseudo-random block of patternPeriod bytes (a prime, so it never lines
// up with buffer sizes) repeated, produced by copying rather than byte by
// byte so the upstream is never what limits a benchmark.
func Pattern(size int64) io.Reader { return io.LimitReader(&patternReader{}, size) }

const patternPeriod = 65521

var patternBlock = func() []byte {
	b := make([]byte, 2*patternPeriod)
	for i := range patternPeriod {
		x := uint64(i)
		b[i] = byte(x*2654435761>>13) ^ byte(x)
	}
	copy(b[patternPeriod:], b[:patternPeriod])
	return b
}()

type patternReader struct{ off int64 }

func (p *patternReader) Read(b []byte) (int, error) {
	n := 0
	for n < len(b) {
		start := int(p.off % patternPeriod)
		m := copy(b[n:], patternBlock[start:start+patternPeriod])
		n += m
		p.off += int64(m)
	}
	return n, nil
}

// download streams ?size= bytes of Pattern (default 1 MiB); chunked=1
// omits Content-Length.
func download(w http.ResponseWriter, r *http.Request) {
	size, err := strconv.ParseInt(r.URL.Query().Get("size"), 10, 64)
	if err != nil || size < 0 {
		size = 1 << 20
	}
	w.Header().Set("Content-Type", "application/octet-stream")
	if r.URL.Query().Get("chunked") == "" {
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
	}
	buf := make([]byte, 256<<10)
	io.CopyBuffer(w, Pattern(size), buf)
}

func wsEcho(w http.ResponseWriter, r *http.Request) {
	c, err := websocket.Accept(w, r, nil)
	if err != nil {
		return
	}
	defer c.CloseNow()
	c.SetReadLimit(16 << 20)
	ctx := r.Context()
	for {
		typ, msg, err := c.Read(ctx)
		if err != nil {
			return
		}
		if err := c.Write(ctx, typ, msg); err != nil {
			return
		}
	}
}

// sse sends ?n= events (default 10) every ?every= (default 100ms).
func sse(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.Atoi(r.URL.Query().Get("n"))
	if err != nil || n <= 0 {
		n = 10
	}
	every, err := time.ParseDuration(r.URL.Query().Get("every"))
	if err != nil || every <= 0 {
		every = 100 * time.Millisecond
	}
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	rc := http.NewResponseController(w)
	t := time.NewTicker(every)
	defer t.Stop()
	for i := 1; i <= n; i++ {
		fmt.Fprintf(w, "id: %d\ndata: event %d at %s\n\n", i, i, time.Now().Format(time.RFC3339Nano))
		if err := rc.Flush(); err != nil {
			return
		}
		if i == n {
			return
		}
		select {
		case <-t.C:
		case <-r.Context().Done():
			return
		}
	}
}

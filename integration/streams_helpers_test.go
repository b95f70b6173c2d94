package integration

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

func init() {
	caddy.RegisterModule(testLogFile{})
}

// testLogFile is a Caddy log writer for these tests: `output
// sluice_test_file <path>` appends to path. (Caddy's own `output file`
// lives in modules/logging, whose rolling-file dependency is not in this
// module's go.sum.) A writer that is not a standard stream gets Caddy's
// JSON encoder by default.
type testLogFile struct {
	Path string `json:"path,omitempty"`
}

// CaddyModule returns the Caddy module information.
func (testLogFile) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{
		ID:  "caddy.logging.writers.sluice_test_file",
		New: func() caddy.Module { return new(testLogFile) },
	}
}

func (w testLogFile) String() string    { return "sluice test log " + w.Path }
func (w testLogFile) WriterKey() string { return "sluice_test_file:" + w.Path }

func (w testLogFile) OpenWriter() (io.WriteCloser, error) {
	return os.OpenFile(w.Path, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o600)
}

// UnmarshalCaddyfile reads `sluice_test_file <path>`.
func (w *testLogFile) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // writer name
	if !d.NextArg() {
		return d.ArgErr()
	}
	w.Path = d.Val()
	return nil
}

func (c *caddyServer) httpsAddr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(c.httpsPort))
}
func (c *caddyServer) httpAddr() string {
	return net.JoinHostPort("127.0.0.1", strconv.Itoa(c.httpPort))
}

// streamLine is one "stream closed" log line of the sluice handler.
type streamLine struct {
	Logger         string  `json:"logger"`
	Msg            string  `json:"msg"`
	Host           string  `json:"host"`
	URI            string  `json:"uri"`
	Classification string  `json:"classification"`
	Outcome        string  `json:"outcome"`
	Duration       float64 `json:"duration"`
	BytesIn        int64   `json:"bytes_in"`
	BytesOut       int64   `json:"bytes_out"`
}

// streamLines parses the "stream closed" lines logged so far.
func (c *caddyServer) streamLines(t testing.TB) []streamLine {
	t.Helper()
	var out []streamLine
	for _, line := range c.logLines(t, "stream closed") {
		var l streamLine
		if err := json.Unmarshal(line, &l); err != nil {
			t.Fatalf("log line %q: %v", line, err)
		}
		out = append(out, l)
	}
	return out
}

// logLines returns the JSON lines of the captured Caddy log (CaptureLog)
// whose message is msg.
func (c *caddyServer) logLines(t testing.TB, msg string) [][]byte {
	t.Helper()
	b, err := os.ReadFile(c.logPath)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("reading the Caddy log: %v", err)
	}
	var out [][]byte
	for _, line := range bytes.Split(b, []byte("\n")) {
		var l struct {
			Msg string `json:"msg"`
		}
		if json.Unmarshal(line, &l) == nil && l.Msg == msg {
			out = append(out, line)
		}
	}
	return out
}

// waitStreamLine waits (bounded) for the "stream closed" line of uri.
func (c *caddyServer) waitStreamLine(t testing.TB, uri string, within time.Duration) streamLine {
	t.Helper()
	var found *streamLine
	deadline := time.Now().Add(within)
	for found == nil {
		for _, l := range c.streamLines(t) {
			if l.URI == uri {
				found = &l
				break
			}
		}
		if found != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no \"stream closed\" line for %s within %v; lines: %+v", uri, within, c.streamLines(t))
		}
		time.Sleep(20 * time.Millisecond)
	}
	if n := c.countStreamLines(t, uri); n != 1 {
		t.Fatalf("%d \"stream closed\" lines for %s, want exactly one", n, uri)
	}
	return *found
}

func (c *caddyServer) countStreamLines(t testing.TB, uri string) int {
	n := 0
	for _, l := range c.streamLines(t) {
		if l.URI == uri {
			n++
		}
	}
	return n
}

// expectStreamLine checks a logged stream's classification and outcome.
func (c *caddyServer) expectStreamLine(t testing.TB, uri, class, outcome string) streamLine {
	t.Helper()
	l := c.waitStreamLine(t, uri, 10*time.Second)
	if l.Classification != class || l.Outcome != outcome || l.Logger != "http.handlers.sluice" {
		t.Fatalf("stream %s logged %+v, want classification %q outcome %q", uri, l, class, outcome)
	}
	return l
}

// Clients for the three edge protocols.

func h1Client() *http.Client {
	return &http.Client{Transport: &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: 64}}
}

// h2cClient speaks HTTP/2 with prior knowledge on Caddy's plain HTTP port.
func h2cClient() *http.Client {
	var only http.Protocols
	only.SetUnencryptedHTTP2(true) // and not HTTP/1: prior knowledge
	return &http.Client{Transport: &http.Transport{Protocols: &only, DisableCompression: true}}
}

// h2TLSClient speaks HTTP/2 over TLS (ALPN) to addr whatever the URL's
// host, trusting any certificate (Caddy's internal CA).
func h2TLSClient(addr, serverName string) *http.Client {
	return &http.Client{Transport: &http.Transport{
		TLSClientConfig:    insecureTLS(serverName),
		ForceAttemptHTTP2:  true,
		DisableCompression: true,
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}}
}

// sseEvent is one server-sent event block: its lines without the blank
// line that ends it.
type sseEvent string

// sseStream reads a server-sent event response block by block in the
// background, so every wait on it is bounded.
type sseStream struct {
	resp   *http.Response
	cancel context.CancelFunc
	events chan sseEvent
	ended  chan struct{}
	endErr error // nil: a clean end (EOF after a complete event)
}

// openSSE sends req (with a 60 s bound on the whole exchange) and returns
// the stream once the response head arrived.
func openSSE(t testing.TB, client *http.Client, req *http.Request) *sseStream {
	t.Helper()
	ctx, cancel := context.WithTimeout(req.Context(), 60*time.Second)
	resp, err := client.Do(req.WithContext(ctx))
	if err != nil {
		cancel()
		t.Fatalf("%s %s: %v", req.Method, req.URL, err)
	}
	s := &sseStream{resp: resp, cancel: cancel, events: make(chan sseEvent, 1024), ended: make(chan struct{})}
	t.Cleanup(s.close)
	go s.read()
	return s
}

func (s *sseStream) read() {
	defer close(s.ended)
	defer close(s.events)
	r := bufio.NewReader(s.resp.Body)
	var block []string
	for {
		line, err := r.ReadString('\n')
		if err != nil {
			if errors.Is(err, io.EOF) && line == "" && len(block) == 0 {
				return // clean end
			}
			if err == io.EOF {
				err = io.ErrUnexpectedEOF
			}
			s.endErr = err
			return
		}
		line = strings.TrimRight(line, "\r\n")
		if line == "" {
			if len(block) > 0 {
				s.events <- sseEvent(strings.Join(block, "\n"))
				block = nil
			}
			continue
		}
		block = append(block, line)
	}
}

func (s *sseStream) close() {
	s.cancel()
	s.resp.Body.Close()
}

// next returns the next event, or an error when the stream ended or none
// came within d.
func (s *sseStream) next(d time.Duration) (sseEvent, error) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case ev, ok := <-s.events:
		if !ok {
			<-s.ended
			if s.endErr == nil {
				return "", io.EOF
			}
			return "", s.endErr
		}
		return ev, nil
	case <-timer.C:
		return "", fmt.Errorf("no event within %v", d)
	}
}

// mustNext returns the next event or fails the test.
func (s *sseStream) mustNext(t testing.TB, d time.Duration) sseEvent {
	t.Helper()
	ev, err := s.next(d)
	if err != nil {
		t.Fatalf("reading the next event: %v", err)
	}
	return ev
}

// end waits up to d for the stream to end, discarding events: it returns
// how many events came before the end, whether it ended, and how (nil:
// cleanly).
func (s *sseStream) end(d time.Duration) (events int, ended bool, err error) {
	timer := time.NewTimer(d)
	defer timer.Stop()
	for {
		select {
		case _, open := <-s.events:
			if !open {
				<-s.ended
				return events, true, s.endErr
			}
			events++
		case <-timer.C:
			return events, false, nil
		}
	}
}

// sseRequest builds a GET for an event stream on host.
func sseRequest(t testing.TB, url, host string, accept bool) *http.Request {
	t.Helper()
	req, err := http.NewRequest("GET", url, nil)
	if err != nil {
		t.Fatal(err)
	}
	req.Host = host
	if accept {
		req.Header.Set("Accept", "text/event-stream")
	}
	return req
}

// serveUpstream serves h (HTTP/1.1 and h2c, like the sample app) on
// loopback and returns its URL.
func serveUpstream(t testing.TB, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := sampleupstream.Server(h)
	go srv.Serve(ln)
	t.Cleanup(func() { srv.Close() })
	return "http://" + ln.Addr().String()
}

// gatedUpstream serves /gated?id=: event 1 at once, then event 2 only when
// the test opens the id's gate. It records the protocol each id arrived
// with. /h2c/... is the same application.
type gatedUpstream struct {
	url    string
	mu     sync.Mutex
	gates  map[string]chan struct{}
	protos map[string]string
}

func startGatedUpstream(t testing.TB) *gatedUpstream {
	t.Helper()
	g := &gatedUpstream{gates: map[string]chan struct{}{}, protos: map[string]string{}}
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) { fmt.Fprintln(w, "ok") })
	mux.HandleFunc("/gated", g.serve)
	root := http.NewServeMux()
	root.Handle("/h2c/", http.StripPrefix("/h2c", mux))
	root.Handle("/", mux)
	g.url = serveUpstream(t, root)
	return g
}

// gate returns the channel that releases event 2 of id.
func (g *gatedUpstream) gate(id string) chan struct{} {
	g.mu.Lock()
	defer g.mu.Unlock()
	ch := make(chan struct{})
	g.gates[id] = ch
	return ch
}

func (g *gatedUpstream) proto(id string) string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.protos[id]
}

func (g *gatedUpstream) serve(w http.ResponseWriter, r *http.Request) {
	id := r.URL.Query().Get("id")
	g.mu.Lock()
	gate := g.gates[id]
	g.protos[id] = r.Proto
	g.mu.Unlock()
	if gate == nil {
		http.Error(w, "unknown gate", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "text/event-stream; charset=utf-8")
	w.Header().Set("Cache-Control", "no-cache")
	w.Header().Set("X-Upstream", "gated")
	serveTwoEvents(w, r, gate)
}

// serveTwoEvents sends an event stream's first event at once and its
// second when release closes (bounded: the request's end, or 30 s, end it
// without). The caller has set the headers.
func serveTwoEvents(w http.ResponseWriter, r *http.Request, release <-chan struct{}) {
	rc := http.NewResponseController(w)
	fmt.Fprint(w, "id: 1\ndata: one\n\n")
	if rc.Flush() != nil {
		return
	}
	select {
	case <-release:
	case <-r.Context().Done():
		return
	case <-time.After(30 * time.Second):
		return
	}
	fmt.Fprint(w, "id: 2\ndata: two\n\n")
	rc.Flush()
}

// policyUpstream has the handlers of the classification tests. Each
// records, by its ?id=, whether the proxy gave up on it (its request
// context ended) before it answered or while it streamed.
type policyUpstream struct {
	url    string
	mu     sync.Mutex
	cut    map[string]chan struct{} // closed when the request's context ends early
	protos map[string]string        // the protocol each id arrived with
}

func startPolicyUpstream(t testing.TB) *policyUpstream {
	t.Helper()
	p := &policyUpstream{cut: map[string]chan struct{}{}, protos: map[string]string{}}
	mux := http.NewServeMux()
	// /json?delay=: an ordinary JSON answer whose head comes after delay.
	mux.HandleFunc("/json", func(w http.ResponseWriter, r *http.Request) {
		if !p.wait(r) {
			return
		}
		w.Header().Set("Content-Type", "application/json")
		fmt.Fprintln(w, `{"ok":true}`)
	})
	// /events?delay=: an event stream whose head comes after delay, then
	// one event and the end.
	mux.HandleFunc("/events", func(w http.ResponseWriter, r *http.Request) {
		if !p.wait(r) {
			return
		}
		w.Header().Set("Content-Type", "text/event-stream")
		fmt.Fprint(w, "data: hello\n\n")
	})
	// /silent: an event stream that sends one event and then nothing
	// until the proxy gives up (or 30 s pass); /feed: the same as NDJSON
	// (a stream only by its path prefix).
	mux.HandleFunc("/silent", p.oneThenSilence("text/event-stream"))
	mux.HandleFunc("/feed", p.oneThenSilence("application/x-ndjson"))
	// Everything else is the sample application (/sse?n=&every=).
	mux.Handle("/", sampleupstream.Handler("policy"))
	p.url = serveUpstream(t, mux)
	return p
}

func (p *policyUpstream) oneThenSilence(contentType string) http.HandlerFunc {
	return func(w http.ResponseWriter, r *http.Request) {
		w.Header().Set("Content-Type", contentType)
		fmt.Fprint(w, "data: only\n\n")
		http.NewResponseController(w).Flush()
		select {
		case <-r.Context().Done():
			p.markCut(r)
		case <-time.After(30 * time.Second):
		}
	}
}

// proto returns the protocol request id arrived with ("" before it did).
func (p *policyUpstream) proto(id string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.protos[id]
}

// wait records the request's protocol and sleeps ?delay= unless the
// request is given up first (recorded).
func (p *policyUpstream) wait(r *http.Request) bool {
	p.mu.Lock()
	p.protos[r.URL.Query().Get("id")] = r.Proto
	p.mu.Unlock()
	d, _ := time.ParseDuration(r.URL.Query().Get("delay"))
	select {
	case <-time.After(d):
		return true
	case <-r.Context().Done():
		p.markCut(r)
		return false
	}
}

func (p *policyUpstream) cutCh(id string) chan struct{} {
	p.mu.Lock()
	defer p.mu.Unlock()
	ch, ok := p.cut[id]
	if !ok {
		ch = make(chan struct{})
		p.cut[id] = ch
	}
	return ch
}

func (p *policyUpstream) markCut(r *http.Request) { close(p.cutCh(r.URL.Query().Get("id"))) }

// expectCut waits (bounded) until the upstream request id was given up by
// the proxy.
func (p *policyUpstream) expectCut(t testing.TB, id string, within time.Duration) {
	t.Helper()
	select {
	case <-p.cutCh(id):
	case <-time.After(within):
		t.Fatalf("upstream request %s was not cancelled within %v", id, within)
	}
}

// grpcTestServer implements grpc.testing.TestService: every call echoes
// the client's x-client-key metadata in a response header (h:<key>) and a
// trailer (t:<key>), and answers ResponseStatus when one is asked for.
type grpcTestServer struct {
	testpb.UnimplementedTestServiceServer
}

func clientKey(ctx context.Context) string {
	md, _ := metadata.FromIncomingContext(ctx)
	if v := md.Get("x-client-key"); len(v) > 0 {
		return v[0]
	}
	return "<none>"
}

func echoStatus(st *testpb.EchoStatus) error {
	if st == nil || st.GetCode() == 0 {
		return nil
	}
	return status.Error(codes.Code(st.GetCode()), st.GetMessage())
}

func (grpcTestServer) UnaryCall(ctx context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	key := clientKey(ctx)
	grpc.SetHeader(ctx, metadata.Pairs("x-header-echo", "h:"+key))
	grpc.SetTrailer(ctx, metadata.Pairs("x-trailer-echo", "t:"+key))
	if err := echoStatus(req.GetResponseStatus()); err != nil {
		return nil, err
	}
	body := append([]byte(key+":"), req.GetPayload().GetBody()...)
	return &testpb.SimpleResponse{Payload: &testpb.Payload{Body: body}}, nil
}

func (grpcTestServer) StreamingOutputCall(req *testpb.StreamingOutputCallRequest, stream grpc.ServerStreamingServer[testpb.StreamingOutputCallResponse]) error {
	key := clientKey(stream.Context())
	stream.SetHeader(metadata.Pairs("x-header-echo", "h:"+key))
	stream.SetTrailer(metadata.Pairs("x-trailer-echo", "t:"+key))
	for i, p := range req.GetResponseParameters() {
		if d := time.Duration(p.GetIntervalUs()) * time.Microsecond; d > 0 {
			select {
			case <-time.After(min(d, 5*time.Second)):
			case <-stream.Context().Done():
				return stream.Context().Err()
			}
		}
		body := []byte(strings.Repeat(strconv.Itoa(i%10), int(p.GetSize())))
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: &testpb.Payload{Body: body}}); err != nil {
			return err
		}
	}
	return echoStatus(req.GetResponseStatus())
}

func (grpcTestServer) StreamingInputCall(stream grpc.ClientStreamingServer[testpb.StreamingInputCallRequest, testpb.StreamingInputCallResponse]) error {
	key := clientKey(stream.Context())
	stream.SetHeader(metadata.Pairs("x-header-echo", "h:"+key))
	stream.SetTrailer(metadata.Pairs("x-trailer-echo", "t:"+key))
	total := 0
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			return stream.SendAndClose(&testpb.StreamingInputCallResponse{AggregatedPayloadSize: int32(total)})
		}
		if err != nil {
			return err
		}
		total += len(req.GetPayload().GetBody())
	}
}

// FullDuplexCall sends its response headers before reading anything, then
// answers every request with its payload, and ends (with the requested
// status, if any) when the client closes its side.
func (grpcTestServer) FullDuplexCall(stream grpc.BidiStreamingServer[testpb.StreamingOutputCallRequest, testpb.StreamingOutputCallResponse]) error {
	key := clientKey(stream.Context())
	if err := stream.SendHeader(metadata.Pairs("x-header-echo", "h:"+key)); err != nil {
		return err
	}
	stream.SetTrailer(metadata.Pairs("x-trailer-echo", "t:"+key))
	var last *testpb.StreamingOutputCallRequest
	for {
		req, err := stream.Recv()
		if err == io.EOF {
			if last != nil {
				return echoStatus(last.GetResponseStatus())
			}
			return nil
		}
		if err != nil {
			return err
		}
		last = req
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: req.GetPayload()}); err != nil {
			return err
		}
	}
}

// startGRPCServer serves the test service (plaintext h2c) on loopback.
func startGRPCServer(t testing.TB) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	s := grpc.NewServer()
	testpb.RegisterTestServiceServer(s, grpcTestServer{})
	go s.Serve(ln)
	t.Cleanup(s.Stop)
	return ln.Addr().String()
}

// waitHostStreamLine waits (bounded) for the one "stream closed" line of a
// request to host.
func (c *caddyServer) waitHostStreamLine(t testing.TB, host string, within time.Duration) streamLine {
	t.Helper()
	var lines []streamLine
	eventually(t, within, "a \"stream closed\" line for "+host, func() bool {
		lines = lines[:0]
		for _, l := range c.streamLines(t) {
			if l.Host == host {
				lines = append(lines, l)
			}
		}
		return len(lines) > 0
	})
	if len(lines) != 1 {
		t.Fatalf("%d \"stream closed\" lines for %s, want exactly one: %+v", len(lines), host, lines)
	}
	return lines[0]
}

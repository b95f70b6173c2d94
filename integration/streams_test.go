package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/coder/websocket"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/agent"
)

// sseMatrixSites serves sse.test on the plain port (HTTP/1.1 and h2c) and
// on the TLS port (HTTP/2 by ALPN, tls internal); /h2c/... goes to the
// upstream over h2c, the rest over HTTP/1.1.
const sseMatrixSites = `(sse) {
	@h2c path /h2c/*
	handle @h2c {
		sluice {
			transport sluice {
				versions h2c
			}
		}
	}
	handle {
		sluice
	}
}

http://:{HTTP} {
	import sse
}

https://sse.test:{HTTPS} {
	tls internal
	import sse
}`

const serversH1H2H2C = `	servers {
		protocols h1 h2 h2c
	}`

// TestSSEPassthroughMatrix sends an event stream through every pairing of
// edge protocol (HTTP/1.1, HTTP/2 over TLS, h2c) and upstream protocol
// (HTTP/1.1, h2c). The upstream writes event 1 and then waits for the
// test: the client must hold event 1 before event 2 is even written (no
// buffering, no coalescing), with the upstream's headers and no
// Content-Length.
func TestSSEPassthroughMatrix(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Global: serversH1H2H2C, NoRedirects: true, CaptureLog: true}, sseMatrixSites)
	up := startGatedUpstream(t)
	startAgent(t, c.serverURL(), "agent-sse", agent.Upstream{Host: "sse.test", Target: up.url})

	tlsBase := fmt.Sprintf("https://sse.test:%d", c.httpsPort)
	tlsClient := h2TLSClient(c.httpsAddr(), "sse.test")
	// The internal certificate is issued just after start: wait for it.
	eventually(t, 20*time.Second, "the HTTPS site to answer", func() bool {
		resp, err := tlsClient.Get(tlsBase + "/")
		if err != nil {
			return false
		}
		resp.Body.Close()
		return resp.StatusCode == 200
	})

	edges := []struct {
		name   string
		client *http.Client
		base   string
		proto  int
	}{
		{"edge-h1", h1Client(), c.url(""), 1},
		{"edge-h2-tls", tlsClient, tlsBase, 2},
		{"edge-h2c", h2cClient(), c.url(""), 2},
	}
	upstreams := []struct {
		name, prefix, proto string
	}{
		{"upstream-h1", "", "HTTP/1.1"},
		{"upstream-h2c", "/h2c", "HTTP/2.0"},
	}
	for _, e := range edges {
		for _, u := range upstreams {
			t.Run(e.name+"/"+u.name, func(t *testing.T) {
				id := e.name + "-" + u.name
				gate := up.gate(id)
				s := openSSE(t, e.client, sseRequest(t, e.base+u.prefix+"/gated?id="+id, "sse.test", true))
				resp := s.resp
				if resp.StatusCode != 200 || resp.ProtoMajor != e.proto {
					t.Fatalf("status %d proto %s, want 200 over HTTP/%d", resp.StatusCode, resp.Proto, e.proto)
				}
				if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream; charset=utf-8" {
					t.Errorf("Content-Type %q, want the upstream's with its parameter", ct)
				}
				if cc := resp.Header.Get("Cache-Control"); cc != "no-cache" {
					t.Errorf("Cache-Control %q, want no-cache", cc)
				}
				if xu := resp.Header.Get("X-Upstream"); xu != "gated" {
					t.Errorf("X-Upstream %q: not the upstream's headers", xu)
				}
				if _, ok := resp.Header["Content-Length"]; ok || resp.ContentLength != -1 {
					t.Errorf("a stream must have no Content-Length: header %q, length %d", resp.Header.Get("Content-Length"), resp.ContentLength)
				}
				if e.proto == 1 && (len(resp.TransferEncoding) != 1 || resp.TransferEncoding[0] != "chunked") {
					t.Errorf("HTTP/1.1 stream framing %v, want chunked", resp.TransferEncoding)
				}

				// Event 1 arrives while the upstream still waits to write
				// event 2: nothing in between buffers.
				if ev := s.mustNext(t, 10*time.Second); ev != "id: 1\ndata: one" {
					t.Fatalf("first event %q", ev)
				}
				close(gate)
				if ev := s.mustNext(t, 10*time.Second); ev != "id: 2\ndata: two" {
					t.Fatalf("second event %q", ev)
				}
				if n, ended, err := s.end(10 * time.Second); !ended || err != nil || n != 0 {
					t.Fatalf("stream end: ended %v, err %v, %d extra events", ended, err, n)
				}
				if got := up.proto(id); got != u.proto {
					t.Fatalf("upstream saw %s, want %s", got, u.proto)
				}
			})
		}
	}
}

// policySites gives each host its own stream policy.
const policySites = `http://a.test:{HTTP} {
	sluice {
		max_request_time 300ms
	}
}

http://b.test:{HTTP} {
	sluice {
		stream_path_prefixes /events
		max_request_time 300ms
		stream_max_request_time 2s
	}
}

http://c.test:{HTTP} {
	sluice {
		max_request_time 500ms
	}
}

http://d.test:{HTTP} {
	sluice {
		stream_idle_timeout 300ms
	}
}

http://e.test:{HTTP} {
	sluice
}

http://f.test:{HTTP} {
	sluice {
		stream_path_prefixes /feed
		stream_idle_timeout 300ms
	}
}

http://g.test:{HTTP} {
	sluice {
		max_request_time 300ms
		transport sluice {
			versions h2c
		}
	}
}

http://h.test:{HTTP} {
	sluice {
		max_request_time 300ms
		lb_try_duration 60s
	}
}`

// TestStreamPolicyClassification drives each way an exchange becomes (or
// does not become) a stream with a purpose-built upstream, and checks the
// deadlines that follow and the one "stream closed" line each stream logs.
func TestStreamPolicyClassification(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, policySites)
	up := startPolicyUpstream(t)
	startAgent(t, c.serverURL(), "agent-policy", agent.Upstream{Host: "*", Target: up.url})
	client := h1Client()

	do := func(t *testing.T, host, path string, accept bool) (*http.Response, string) {
		t.Helper()
		req := sseRequest(t, c.url(path), host, accept)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		resp, err := client.Do(req.WithContext(ctx))
		if err != nil {
			t.Fatalf("GET %s%s: %v", host, path, err)
		}
		b, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		if err != nil {
			t.Fatalf("GET %s%s: reading the body: %v", host, path, err)
		}
		return resp, string(b)
	}

	t.Run("Accept-only with a JSON answer keeps the ordinary deadline", func(t *testing.T) {
		// Control: a prompt JSON answer passes.
		if resp, body := do(t, "a.test", "/json?delay=0s&id=a0", true); resp.StatusCode != 200 || !strings.Contains(body, `"ok"`) {
			t.Fatalf("prompt JSON: %d %q", resp.StatusCode, body)
		}
		resp, _ := do(t, "a.test", "/json?delay=1s&id=a1", true)
		if resp.StatusCode != http.StatusGatewayTimeout {
			t.Fatalf("status %d, want 504: an Accept header alone must not lift max_request_time", resp.StatusCode)
		}
		// The proxy gave up before the upstream's (1 s late) head.
		up.expectCut(t, "a1", 5*time.Second)
		if n := c.countStreamLines(t, "/json?delay=1s&id=a1"); n != 0 {
			t.Fatalf("an unconfirmed Accept match logged %d stream lines", n)
		}
	})

	t.Run("a deadline before the head of an HTTP/2 upstream is a 504", func(t *testing.T) {
		// Go's HTTP/2 client ends the round trip with context.Canceled,
		// not the deadline's cause, which reverse_proxy takes for a
		// client that left (499).
		if resp, body := do(t, "g.test", "/json?delay=0s&id=g0", false); resp.StatusCode != 200 || !strings.Contains(body, `"ok"`) {
			t.Fatalf("prompt JSON over h2c: %d %q", resp.StatusCode, body)
		}
		if proto := up.proto("g0"); proto != "HTTP/2.0" {
			t.Fatalf("the upstream got %q, want h2c", proto)
		}
		resp, _ := do(t, "g.test", "/json?delay=1s&id=g1", false)
		if resp.StatusCode != http.StatusGatewayTimeout {
			t.Fatalf("status %d, want 504", resp.StatusCode)
		}
		up.expectCut(t, "g1", 5*time.Second)
	})

	t.Run("a deadline is a 504 also when reverse_proxy may retry", func(t *testing.T) {
		// The cut is this node's, not the upstream's failure: reverse_proxy
		// must neither try again until lb_try_duration (60 s, past the
		// client's 20 s) ends nor count it against the agent.
		resp, _ := do(t, "h.test", "/json?delay=1s&id=h1", false)
		if resp.StatusCode != http.StatusGatewayTimeout {
			t.Fatalf("status %d, want 504", resp.StatusCode)
		}
		up.expectCut(t, "h1", 5*time.Second)
	})

	t.Run("path prefix takes the stream deadline before headers", func(t *testing.T) {
		resp, body := do(t, "b.test", "/events?delay=800ms&id=b1", false)
		if resp.StatusCode != 200 || body != "data: hello\n\n" {
			t.Fatalf("/events with headers after 800 ms: %d %q, want 200 (max_request_time 300ms must not apply)", resp.StatusCode, body)
		}
		c.expectStreamLine(t, "/events?delay=800ms&id=b1", "path_prefix", "completed")

		resp, _ = do(t, "b.test", "/events?delay=3s&id=b2", false)
		if resp.StatusCode != http.StatusGatewayTimeout {
			t.Fatalf("/events with headers after 3 s: status %d, want 504 (stream_max_request_time 2s)", resp.StatusCode)
		}
		up.expectCut(t, "b2", 5*time.Second)
		c.expectStreamLine(t, "/events?delay=3s&id=b2", "path_prefix", "exchange_timeout")
	})

	t.Run("Content-Type promotion lifts the ordinary deadline", func(t *testing.T) {
		// 15 events 100 ms apart: 1.4 s, well past max_request_time 500ms.
		uri := "/sse?n=15&every=100ms&id=c"
		s := openSSE(t, client, sseRequest(t, c.url(uri), "c.test", false))
		n, ended, err := s.end(20 * time.Second)
		if !ended || err != nil || n != 15 {
			t.Fatalf("promoted stream: %d of 15 events, ended %v, err %v", n, ended, err)
		}
		c.expectStreamLine(t, uri, "response_content_type", "completed")
	})

	// expectIdleCut: a stream that sends one line and then nothing is cut
	// within 2 s by its site's stream_idle_timeout of 300ms, the upstream
	// request is closed too, and the stream's line says idle_timeout.
	expectIdleCut := func(t *testing.T, uri, id, host string, accept bool, class string) {
		t.Helper()
		s := openSSE(t, client, sseRequest(t, c.url(uri), host, accept))
		if ev := s.mustNext(t, 10*time.Second); ev != "data: only" {
			t.Fatalf("first line %q", ev)
		}
		n, ended, err := s.end(2 * time.Second)
		if !ended || n != 0 {
			t.Fatalf("silent stream not cut within 2 s of its last line (stream_idle_timeout 300ms): ended %v, %d lines", ended, n)
		}
		t.Logf("silent stream ended with %v", err)
		up.expectCut(t, id, 5*time.Second)
		c.expectStreamLine(t, uri, class, "idle_timeout")
	}

	t.Run("idle timeout cuts a silent stream", func(t *testing.T) {
		expectIdleCut(t, "/silent?id=d1", "d1", "d.test", true, "request_accept")
	})

	t.Run("idle timeout cuts a silent path-prefix stream of any type", func(t *testing.T) {
		expectIdleCut(t, "/feed?id=f1", "f1", "f.test", false, "path_prefix") // NDJSON
	})

	t.Run("idle timeout spares a stream that keeps talking", func(t *testing.T) {
		uri := "/sse?n=16&every=100ms&id=d2"
		s := openSSE(t, client, sseRequest(t, c.url(uri), "d.test", true))
		n, ended, err := s.end(20 * time.Second)
		if !ended || err != nil || n != 16 {
			t.Fatalf("talking stream: %d of 16 events, ended %v, err %v", n, ended, err)
		}
		c.expectStreamLine(t, uri, "request_accept", "completed")
	})

	t.Run("client disconnect is logged as such", func(t *testing.T) {
		uri := "/sse?n=300&every=100ms&id=e"
		s := openSSE(t, client, sseRequest(t, c.url(uri), "e.test", true))
		s.mustNext(t, 10*time.Second)
		s.mustNext(t, 10*time.Second)
		s.close()
		l := c.expectStreamLine(t, uri, "request_accept", "client_disconnect")
		if l.BytesOut == 0 {
			t.Fatalf("stream line counts no bytes: %+v", l)
		}
	})
}

// grpcSite proxies every host to the agents' upstreams over h2c.
const grpcSite = `http://:{HTTP} {
	sluice {
		transport sluice {
			versions h2c
		}
	}
}`

func grpcClient(t testing.TB, addr, authority string) testpb.TestServiceClient {
	t.Helper()
	opts := []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}
	if authority != "" {
		opts = append(opts, grpc.WithAuthority(authority))
	}
	cc, err := grpc.NewClient(addr, opts...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return testpb.NewTestServiceClient(cc)
}

// TestGRPCThroughTunnel runs the four kinds of call against a real gRPC
// server, once directly (the reference) and once through Caddy's h2c port
// and the tunnel: the same metadata, headers, trailers and statuses must
// come through.
func TestGRPCThroughTunnel(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, grpcSite)
	srv := startGRPCServer(t)
	startAgent(t, c.serverURL(), "agent-grpc", agent.Upstream{Host: "grpc.test", Target: "http://" + srv})

	for _, target := range []struct{ name, addr, authority string }{
		{"direct", srv, ""},
		{"tunnel", c.httpAddr(), "grpc.test"},
	} {
		t.Run(target.name, func(t *testing.T) {
			checkTestService(t, grpcClient(t, target.addr, target.authority))
		})
	}
}

func callCtx(t testing.TB, key string) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	t.Cleanup(cancel)
	return metadata.AppendToOutgoingContext(ctx, "x-client-key", key)
}

func expectMD(t testing.TB, what string, md metadata.MD, key, want string) {
	t.Helper()
	if got := md.Get(key); len(got) != 1 || got[0] != want {
		t.Fatalf("%s %s = %q, want %q (all: %v)", what, key, got, want, md)
	}
}

func checkTestService(t *testing.T, client testpb.TestServiceClient) {
	nope := &testpb.EchoStatus{Code: int32(codes.FailedPrecondition), Message: "nope"}

	t.Run("unary", func(t *testing.T) {
		var header, trailer metadata.MD
		resp, err := client.UnaryCall(callCtx(t, "k1"), &testpb.SimpleRequest{Payload: &testpb.Payload{Body: []byte("hello")}},
			grpc.Header(&header), grpc.Trailer(&trailer))
		if err != nil {
			t.Fatal(err)
		}
		if got := string(resp.GetPayload().GetBody()); got != "k1:hello" {
			t.Fatalf("payload %q: request metadata did not reach the server", got)
		}
		expectMD(t, "header", header, "x-header-echo", "h:k1")
		expectMD(t, "trailer", trailer, "x-trailer-echo", "t:k1")
	})

	t.Run("unary error status", func(t *testing.T) {
		var trailer metadata.MD
		_, err := client.UnaryCall(callCtx(t, "k2"), &testpb.SimpleRequest{ResponseStatus: nope}, grpc.Trailer(&trailer))
		if st := status.Convert(err); st.Code() != codes.FailedPrecondition || st.Message() != "nope" {
			t.Fatalf("status %v, want FailedPrecondition \"nope\"", err)
		}
		expectMD(t, "trailer", trailer, "x-trailer-echo", "t:k2")
	})

	t.Run("server streaming", func(t *testing.T) {
		sizes := []int32{10, 2000, 70000, 1}
		req := &testpb.StreamingOutputCallRequest{}
		for _, n := range sizes {
			req.ResponseParameters = append(req.ResponseParameters, &testpb.ResponseParameters{Size: n, IntervalUs: 20000})
		}
		stream, err := client.StreamingOutputCall(callCtx(t, "k3"), req)
		if err != nil {
			t.Fatal(err)
		}
		header, err := stream.Header()
		if err != nil {
			t.Fatal(err)
		}
		expectMD(t, "header", header, "x-header-echo", "h:k3")
		for i, n := range sizes {
			resp, err := stream.Recv()
			if err != nil {
				t.Fatalf("message %d: %v", i, err)
			}
			if body := resp.GetPayload().GetBody(); len(body) != int(n) || (n > 0 && body[0] != byte('0'+i)) {
				t.Fatalf("message %d: %d bytes, want %d", i, len(body), n)
			}
		}
		if _, err := stream.Recv(); err != io.EOF {
			t.Fatalf("end of stream: %v", err)
		}
		expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:k3")
	})

	t.Run("server streaming ending in an error status", func(t *testing.T) {
		req := &testpb.StreamingOutputCallRequest{
			ResponseParameters: []*testpb.ResponseParameters{{Size: 5}, {Size: 6}},
			ResponseStatus:     nope,
		}
		stream, err := client.StreamingOutputCall(callCtx(t, "k4"), req)
		if err != nil {
			t.Fatal(err)
		}
		for i := 0; i < 2; i++ {
			if _, err := stream.Recv(); err != nil {
				t.Fatalf("message %d: %v", i, err)
			}
		}
		_, err = stream.Recv()
		if st := status.Convert(err); st.Code() != codes.FailedPrecondition || st.Message() != "nope" {
			t.Fatalf("status %v, want FailedPrecondition \"nope\"", err)
		}
		expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:k4")
	})

	t.Run("client streaming", func(t *testing.T) {
		stream, err := client.StreamingInputCall(callCtx(t, "k5"))
		if err != nil {
			t.Fatal(err)
		}
		total := 0
		for _, n := range []int{100, 300000, 7} {
			total += n
			if err := stream.Send(&testpb.StreamingInputCallRequest{Payload: &testpb.Payload{Body: make([]byte, n)}}); err != nil {
				t.Fatal(err)
			}
		}
		resp, err := stream.CloseAndRecv()
		if err != nil {
			t.Fatal(err)
		}
		if int(resp.GetAggregatedPayloadSize()) != total {
			t.Fatalf("aggregated %d, want %d", resp.GetAggregatedPayloadSize(), total)
		}
		header, err := stream.Header()
		if err != nil {
			t.Fatal(err)
		}
		expectMD(t, "header", header, "x-header-echo", "h:k5")
		expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:k5")
	})

	t.Run("bidi, headers read before the first message", func(t *testing.T) {
		stream, err := client.FullDuplexCall(callCtx(t, "k6"))
		if err != nil {
			t.Fatal(err)
		}
		// Nothing sent yet: the server's headers must come through on
		// their own.
		header, err := stream.Header()
		if err != nil {
			t.Fatal(err)
		}
		expectMD(t, "header", header, "x-header-echo", "h:k6")
		for i := 0; i < 20; i++ {
			msg := fmt.Sprintf("ping %d", i)
			if err := stream.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte(msg)}}); err != nil {
				t.Fatal(err)
			}
			resp, err := stream.Recv()
			if err != nil || string(resp.GetPayload().GetBody()) != msg {
				t.Fatalf("pong %d: %v %v", i, resp, err)
			}
		}
		stream.CloseSend()
		if _, err := stream.Recv(); err != io.EOF {
			t.Fatalf("end of stream: %v", err)
		}
		expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:k6")
	})

	t.Run("bidi ending in an error status", func(t *testing.T) {
		stream, err := client.FullDuplexCall(callCtx(t, "k7"))
		if err != nil {
			t.Fatal(err)
		}
		if err := stream.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte("x")}, ResponseStatus: nope}); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); err != nil {
			t.Fatal(err)
		}
		stream.CloseSend()
		_, err = stream.Recv()
		if st := status.Convert(err); st.Code() != codes.FailedPrecondition || st.Message() != "nope" {
			t.Fatalf("status %v, want FailedPrecondition \"nope\"", err)
		}
		expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:k7")
	})
}

// TestGRPCBidiSurvivesReload keeps a bidi stream pinging every 100 ms for
// 5 s and reloads Caddy with a changed site list halfway: every ping gets
// its pong, and the agent keeps its session.
func TestGRPCBidiSurvivesReload(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, grpcSite)
	srv := startGRPCServer(t)
	a := startAgent(t, c.serverURL(), "agent-grpc", agent.Upstream{Host: "grpc.test", Target: "http://" + srv})
	sessions := a.Sessions()
	client := grpcClient(t, c.httpAddr(), "grpc.test")

	stream, err := client.FullDuplexCall(callCtx(t, "long"))
	if err != nil {
		t.Fatal(err)
	}
	const pings = 50
	tick := time.NewTicker(100 * time.Millisecond)
	defer tick.Stop()
	for i := 0; i < pings; i++ {
		<-tick.C
		if i == pings/2 {
			reloadWithNewSite(t, c, grpcSite)
		}
		msg := fmt.Sprintf("ping %d", i)
		if err := stream.Send(&testpb.StreamingOutputCallRequest{Payload: &testpb.Payload{Body: []byte(msg)}}); err != nil {
			t.Fatalf("send %d: %v", i, err)
		}
		resp, err := stream.Recv()
		if err != nil || string(resp.GetPayload().GetBody()) != msg {
			t.Fatalf("pong %d (reload after %d): %v %v", i, pings/2, resp, err)
		}
	}
	stream.CloseSend()
	if _, err := stream.Recv(); err != io.EOF {
		t.Fatalf("end of stream: %v", err)
	}
	expectMD(t, "trailer", stream.Trailer(), "x-trailer-echo", "t:long")
	if a.Sessions() != sessions || a.State() != agent.StateConnected {
		t.Fatalf("the reload reconnected the agent: sessions %d→%d, state %v", sessions, a.Sessions(), a.State())
	}
	// New calls run under the new config.
	var header metadata.MD
	if _, err := client.UnaryCall(callCtx(t, "after"), &testpb.SimpleRequest{}, grpc.Header(&header)); err != nil {
		t.Fatalf("unary call after the reload: %v", err)
	}
	expectMD(t, "header", header, "x-header-echo", "h:after")
}

// TestReloadKeepsInFlightSSEAndWebSocket reloads Caddy while a slow event
// stream and a WebSocket are open: both carry on to their end.
func TestReloadKeepsInFlightSSEAndWebSocket(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up})
	sessions := a.Sessions()

	uri := "/sse?n=30&every=100ms&id=reload"
	s := openSSE(t, h1Client(), sseRequest(t, c.url(uri), "app.test", true))
	for i := 1; i <= 3; i++ {
		if ev := s.mustNext(t, 10*time.Second); !strings.HasPrefix(string(ev), fmt.Sprintf("id: %d\n", i)) {
			t.Fatalf("event %d: %q", i, ev)
		}
	}
	ws := dialWS(t, c, "app.test")
	defer ws.CloseNow()
	echoWS(t, ws, 10)

	reloadWithNewSite(t, c, siteAll)

	// The stream keeps delivering, in order, to its last event.
	for i := 4; i <= 30; i++ {
		if ev := s.mustNext(t, 10*time.Second); !strings.HasPrefix(string(ev), fmt.Sprintf("id: %d\n", i)) {
			t.Fatalf("event %d after the reload: %q", i, ev)
		}
	}
	if n, ended, err := s.end(10 * time.Second); !ended || err != nil || n != 0 {
		t.Fatalf("stream end after the reload: ended %v, err %v, %d extra events", ended, err, n)
	}
	echoWS(t, ws, 100)
	ws.Close(websocket.StatusNormalClosure, "")
	c.expectStreamLine(t, uri, "request_accept", "completed")

	if a.Sessions() != sessions || a.State() != agent.StateConnected {
		t.Fatalf("the reload reconnected the agent: sessions %d→%d, state %v", sessions, a.Sessions(), a.State())
	}
}

// TestCaddyStopDrainsStreams stops Caddy (in-process: the node drains in
// Cleanup) with drain_grace 2s while a 30 s event stream and a WebSocket
// are open: they keep working during the grace, then the stream is closed
// and logged as a shutdown, and Stop returns.
func TestCaddyStopDrainsStreams(t *testing.T) {
	const grace = 2 * time.Second
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\tdrain_grace 2s", NoRedirects: true, CaptureLog: true}, siteAll)
	up := startUpstream(t, "app")
	slow := startPolicyUpstream(t)
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{Host: "app.test", Target: up},
		agent.Upstream{Host: "slow.test", Target: slow.url})

	// A request whose answer would come after the grace: it is answered
	// 503 when the grace ends (the node is going away; another may serve).
	pending := make(chan int, 1)
	go func() {
		req, _ := http.NewRequest(http.MethodGet, c.url("/json?delay=60s&id=pending"), nil)
		req.Host = "slow.test"
		resp, err := h1Client().Do(req)
		if err != nil {
			t.Logf("pending request: %v", err)
			pending <- 0
			return
		}
		resp.Body.Close()
		if resp.StatusCode == http.StatusServiceUnavailable && resp.Header.Get("Retry-After") == "" {
			t.Error("the 503 at the end of the grace has no Retry-After")
		}
		pending <- resp.StatusCode
	}()

	uri := "/sse?n=300&every=100ms&id=stop"
	s := openSSE(t, h1Client(), sseRequest(t, c.url(uri), "app.test", true))
	s.mustNext(t, 10*time.Second)
	s.mustNext(t, 10*time.Second)
	ws := dialWS(t, c, "app.test")
	defer ws.CloseNow()
	echoWS(t, ws, 10)
	eventually(t, 10*time.Second, "the pending request at the upstream", func() bool { return slow.proto("pending") != "" })

	start := time.Now()
	stopped := make(chan time.Duration, 1)
	go func() {
		caddy.Stop()
		stopped <- time.Since(start)
	}()

	// Caddy stops accepting, then drains: the WebSocket still echoes while
	// Stop is in progress.
	eventually(t, 5*time.Second, "Caddy to stop accepting connections", func() bool {
		conn, err := net.DialTimeout("tcp", c.httpAddr(), time.Second)
		if err != nil {
			return true
		}
		conn.Close()
		return false
	})
	echoWS(t, ws, 3)
	select {
	case d := <-stopped:
		t.Logf("Stop returned after %v, before the WebSocket was checked during the drain", d)
		stopped <- d
	default:
	}

	n, ended, err := s.end(grace + 2*time.Second - time.Since(start))
	if !ended {
		t.Fatalf("the event stream was still open %v after Stop began (drain_grace %v)", time.Since(start), grace)
	}
	endedAfter := time.Since(start)
	t.Logf("event stream: %d events after Stop began, ended after %v with %v", n, endedAfter, err)
	if n == 0 {
		t.Fatal("no event arrived during the drain grace")
	}

	select {
	case d := <-stopped:
		t.Logf("caddy.Stop returned after %v", d)
	case <-time.After(grace + 3*time.Second - time.Since(start)):
		t.Fatalf("caddy.Stop still running %v after it began (drain_grace %v)", time.Since(start), grace)
	}

	select {
	case code := <-pending:
		if code != http.StatusServiceUnavailable {
			t.Fatalf("a request still waiting for its answer at the end of the grace got %d, want 503", code)
		}
	case <-time.After(5 * time.Second):
		t.Fatal("the request waiting for its answer was not answered")
	}
	slow.expectCut(t, "pending", 5*time.Second)

	// The WebSocket was closed with the tunnel.
	rctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if _, _, err := ws.Read(rctx); err == nil || errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("WebSocket still open after Stop: %v", err)
	}
	c.expectStreamLine(t, uri, "request_accept", "shutdown")
}

// TestSSESoak holds 32 event streams with 100 ms heartbeats for 20 s
// through Caddy and the tunnel, then checks that the process gave back
// its file descriptors and memory.
func TestSSESoak(t *testing.T) {
	if testing.Short() {
		t.Skip("20 s soak")
	}
	const streams, events = 32, 200 // 200 events 100 ms apart: 20 s
	// keepalive 1s: pooled idle connections to the agent close soon after
	// the streams, so the descriptor count shows what the streams left.
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, `http://:{HTTP} {
	sluice {
		transport sluice {
			keepalive 1s
		}
	}
}`)

	up := startUpstream(t, "soak")
	startAgent(t, c.serverURL(), "agent-soak", agent.Upstream{Host: "soak.test", Target: up})
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: streams}
	client := &http.Client{Transport: tr}

	// runStreams holds n event streams of events events at once and
	// returns what went wrong.
	runStreams := func(n, events int, every, tag string) []error {
		var wg sync.WaitGroup
		errs := make(chan error, n)
		for i := 0; i < n; i++ {
			wg.Add(1)
			go func(i int) {
				defer wg.Done()
				url := c.url(fmt.Sprintf("/sse?n=%d&every=%s&id=%s%d", events, every, tag, i))
				ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
				defer cancel()
				req, _ := http.NewRequestWithContext(ctx, "GET", url, nil)
				req.Host = "soak.test"
				req.Header.Set("Accept", "text/event-stream")
				resp, err := client.Do(req)
				if err != nil {
					errs <- fmt.Errorf("stream %s%d: %w", tag, i, err)
					return
				}
				defer resp.Body.Close()
				b, err := io.ReadAll(resp.Body)
				if got := strings.Count(string(b), "\ndata: event "); err != nil || got != events {
					errs <- fmt.Errorf("stream %s%d: %d of %d events, %v", tag, i, got, events, err)
				}
			}(i)
		}
		wg.Wait()
		close(errs)
		var out []error
		for err := range errs {
			out = append(out, err)
		}
		return out
	}

	// Warm up with 2 s streams at the same concurrency (lazy pools,
	// buffers, goroutine stacks, a heap sized for 32 streams, and under
	// -race the detector's own tables, are not growth), then let the
	// descriptors of the warm-up settle.
	fds0 := procFDs(t)
	if errs := runStreams(streams, 20, "100ms", "warm"); len(errs) > 0 {
		t.Fatalf("warm-up: %v", errs)
	}
	tr.CloseIdleConnections()
	eventually(t, 15*time.Second, "descriptors after the warm-up to settle", func() bool { return procFDs(t) <= fds0 })
	fdsBefore, rssBefore, gBefore := procFDs(t), procRSS(t), runtime.NumGoroutine()
	var msBefore runtime.MemStats
	runtime.ReadMemStats(&msBefore)

	start := time.Now()
	for _, err := range runStreams(streams, events, "100ms", "soak") {
		t.Error(err)
	}
	took := time.Since(start)
	tr.CloseIdleConnections()

	var fdsAfter int
	eventually(t, 15*time.Second, "descriptors to settle after the streams", func() bool {
		fdsAfter = procFDs(t)
		return fdsAfter <= fdsBefore+4
	})
	rssAfter := procRSS(t)
	var msAfter runtime.MemStats
	runtime.ReadMemStats(&msAfter)
	mib := func(b uint64) float64 { return float64(b) / (1 << 20) }
	t.Logf("soak: %d streams × %d events in %v; fds %d → %d (%+d); RSS %.1f → %.1f MiB (%+.1f MiB); "+
		"Go heap in use %.1f → %.1f MiB, stacks %.1f → %.1f MiB; goroutines %d → %d; race detector %v",
		streams, events, took.Round(time.Millisecond), fdsBefore, fdsAfter, fdsAfter-fdsBefore,
		float64(rssBefore)/(1<<20), float64(rssAfter)/(1<<20), float64(rssAfter-rssBefore)/(1<<20),
		mib(msBefore.HeapInuse), mib(msAfter.HeapInuse), mib(msBefore.StackInuse), mib(msAfter.StackInuse),
		gBefore, runtime.NumGoroutine(), raceBuild())
	// Under -race the detector's shadow memory grows with everything the
	// process has done (a second -count run starts near 900 MiB and grew
	// 98 MiB with the Go heap unchanged), so RSS bounds only a plain build;
	// the heap check below holds for both.
	if rssAfter-rssBefore > 64<<20 && !raceBuild() {
		t.Errorf("RSS grew by %.1f MiB (limit 64 MiB)", float64(rssAfter-rssBefore)/(1<<20))
	}
	// What the streams could leak lives in the Go heap (after a GC);
	// under -race most of the RSS growth is the detector's own memory.
	if grown := int64(msAfter.HeapInuse) - int64(msBefore.HeapInuse); grown > 16<<20 {
		t.Errorf("Go heap in use grew by %.1f MiB (limit 16 MiB)", float64(grown)/(1<<20))
	}
	soakLines := func() []streamLine {
		var out []streamLine
		for _, l := range c.streamLines(t) {
			if strings.Contains(l.URI, "id=soak") {
				out = append(out, l)
			}
		}
		return out
	}
	eventually(t, 10*time.Second, "a \"stream closed\" line per soak stream", func() bool { return len(soakLines()) >= streams })
	if lines := soakLines(); len(lines) != streams {
		t.Errorf("%d \"stream closed\" lines for %d streams", len(lines), streams)
	}
	for _, l := range soakLines() {
		if l.Outcome != "completed" {
			t.Errorf("soak stream %s: outcome %s", l.URI, l.Outcome)
		}
	}
}

// upgradeSites: one host bounds ordinary requests only, the other bounds
// streams too.
const upgradeSites = `http://ws.test:{HTTP} {
	sluice {
		max_request_time 300ms
	}
}

http://wsb.test:{HTTP} {
	sluice {
		max_request_time 300ms
		stream_max_request_time 1s
	}
}`

// TestUpgradedConnectionsOutliveMaxRequestTime: max_request_time bounds an
// ordinary exchange, not a WebSocket once its 101 is out; the stream
// deadline bounds the WebSocket instead, and the close is logged as an
// upgrade.
func TestUpgradedConnectionsOutliveMaxRequestTime(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{NoRedirects: true, CaptureLog: true}, upgradeSites)
	up := startUpstream(t, "app")
	startAgent(t, c.serverURL(), "agent-ws", agent.Upstream{Host: "*", Target: up})

	t.Run("max_request_time does not cut a WebSocket", func(t *testing.T) {
		ws := dialWS(t, c, "ws.test")
		defer ws.CloseNow()
		opened := time.Now()
		for time.Since(opened) < 1200*time.Millisecond { // four times the 300ms deadline
			echoWS(t, ws, 1)
		}
		ws.Close(websocket.StatusNormalClosure, "")
		line := c.waitHostStreamLine(t, "ws.test", 10*time.Second)
		if line.Classification != "upgrade" || line.Outcome != "completed" {
			t.Fatalf("stream line %+v, want classification upgrade, outcome completed", line)
		}
	})

	t.Run("stream_max_request_time cuts a WebSocket", func(t *testing.T) {
		ws := dialWS(t, c, "wsb.test")
		defer ws.CloseNow()
		opened := time.Now()
		echoWS(t, ws, 1)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if _, _, err := ws.Read(ctx); err == nil || ctx.Err() != nil {
			t.Fatalf("read on a WebSocket past stream_max_request_time: %v (context %v), want the connection cut", err, ctx.Err())
		}
		if held := time.Since(opened); held < 900*time.Millisecond {
			t.Fatalf("the WebSocket was cut after %v, before its 1s stream deadline", held)
		}
		line := c.waitHostStreamLine(t, "wsb.test", 10*time.Second)
		if line.Classification != "upgrade" || line.Outcome != "exchange_timeout" {
			t.Fatalf("stream line %+v, want classification upgrade, outcome exchange_timeout", line)
		}
	})
}

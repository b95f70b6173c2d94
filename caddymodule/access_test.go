package caddymodule

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http/httptest"
	"sync/atomic"
	"testing"

	"github.com/caddyserver/caddy/v2"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

func TestTCPOutcome(t *testing.T) {
	for _, c := range []struct {
		err  error
		want string
	}{
		{nil, accessOK},
		{ErrNoRoute, accessNoRoute},
		{errAgentLeft, accessNoRoute},
		{ErrForbidden, accessForbidden},
		{ErrLimit, accessLimit},
		{fmt.Errorf("relaying: %w", &tunnelcore.PeerError{Code: tunnelpb.Error_DIAL_FAILED}), accessDialFailed},
		{&tunnelcore.PeerError{Code: tunnelpb.Error_REFUSED}, accessAgentRefused},
		{&tunnelcore.PeerError{Code: tunnelpb.Error_RESOURCE_EXHAUSTED}, accessLimit},
		{&tunnelcore.PeerError{Code: tunnelpb.Error_RESET}, accessUpstreamReset},
		{fmt.Errorf("relaying: %w", tunnelcore.ErrSessionClosed), accessTunnelError},
		{errors.New("read tcp: connection reset by peer"), accessClientReset},
	} {
		if got := tcpOutcome(c.err); got != c.want {
			t.Errorf("tcpOutcome(%v) = %q, want %q", c.err, got, c.want)
		}
	}
}

func TestTCPAccessOutcomeOfIdleAndOpen(t *testing.T) {
	x := &tcpAccess{}
	x.idle.Store(true)
	if got := x.outcomeOf(errors.New("use of closed connection")); got != accessIdleTimeout {
		t.Errorf("an idle relay's outcome %q, want %q", got, accessIdleTimeout)
	}
	x = &tcpAccess{outcome: accessOpenFailed}
	if got := x.outcomeOf(tunnelcore.ErrSessionClosed); got != accessOpenFailed {
		t.Errorf("a failed open's outcome %q, want %q", got, accessOpenFailed)
	}
}

// TestSetServedByPlaceholders: the request's replacer names the agent,
// route and the session's transport, without allocating.
func TestSetServedByPlaceholders(t *testing.T) {
	repl := caddy.NewReplacer()
	req := httptest.NewRequest("GET", "http://app.test/", nil)
	req = req.WithContext(context.WithValue(req.Context(), caddy.ReplacerCtxKey, repl))
	e := &routeEntry{agent: &agentSession{agentID: "agent-a", idValue: "agent-a", lane: true},
		route: &tunnelpb.Route{Host: "app.test"}, nameValue: "app.test"}
	setServedBy(req, e)
	for k, want := range map[string]string{
		placeholderAgent: "agent-a", placeholderRoute: "app.test", placeholderTransport: transportLane,
	} {
		if got, _ := repl.GetString(k); got != want {
			t.Errorf("{%s} = %q, want %q", k, got, want)
		}
	}
	if n := testing.AllocsPerRun(100, func() { setServedBy(req, e) }); n != 0 {
		t.Errorf("setServedBy allocates %v times per request", n)
	}
	// A request without a replacer (not through caddyhttp) is left alone.
	setServedBy(httptest.NewRequest("GET", "/", nil), e)
}

func TestTunnelConnUnwraps(t *testing.T) {
	a, b := net.Pipe()
	defer a.Close()
	defer b.Close()
	if tunnelConn(a) != nil || tunnelConn(nil) != nil {
		t.Fatal("a pipe is not a virtual connection")
	}
	if got := connTransport(&agentSession{}, nil); got != sessionTransport(&agentSession{}) {
		t.Fatalf("connTransport without a connection = %q", got)
	}
}

// TestCountingConnCountsAndHalfCloses: the hijacked client connection of an
// upgrade counts both ways and keeps CloseWrite.
func TestCountingConnCountsAndHalfCloses(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	go func() {
		s, err := ln.Accept()
		if err == nil {
			s.Write([]byte("hello"))
			buf := make([]byte, 16)
			n, _ := s.Read(buf)
			s.Write(buf[:n]) // echo, then EOF after the client's half-close
			s.Close()
		}
	}()
	raw, err := net.Dial("tcp", ln.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	var in, out atomic.Int64
	c := &countingConn{Conn: raw, in: &in, out: &out}
	defer c.Close()
	buf := make([]byte, 5)
	if _, err := c.Read(buf); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte("abc")); err != nil {
		t.Fatal(err)
	}
	if err := c.CloseWrite(); err != nil {
		t.Fatalf("CloseWrite of a TCP connection: %v", err)
	}
	if _, err := c.Read(buf); err != nil {
		t.Fatal(err)
	}
	if in.Load() != 8 || out.Load() != 3 {
		t.Fatalf("counted %d in, %d out; want 8, 3", in.Load(), out.Load())
	}
	p, q := net.Pipe()
	defer q.Close()
	if err := (&countingConn{Conn: p, in: &in, out: &out}).CloseWrite(); !errors.Is(err, errNoCloseWrite) {
		t.Fatalf("CloseWrite of a pipe: %v", err)
	}
}

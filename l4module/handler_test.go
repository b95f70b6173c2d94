package l4module

import (
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/testnet"

	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"

	"github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/logthrottle"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// testHandler is a Handler whose relay returns err, and the logs it wrote.
func testHandler(route string, err error) (*Handler, *observer.ObservedLogs) {
	core, logs := observer.New(zapcore.DebugLevel)
	h := &Handler{
		Route:   route,
		relay:   func(net.Conn, caddymodule.TCPTarget) error { return err },
		logger:  zap.New(core),
		noRoute: logthrottle.New(time.Minute, 1),
	}
	return h, logs
}

// TestHandleReturnsOnlyRealFailures: caddy-l4 logs a handler's error at
// ERROR level for each connection, so Handle returns the relay's real
// failures, wrapped with the route and still matching the cause, and nil
// for a client hanging up or a connection refused (logged elsewhere,
// throttled).
func TestHandleReturnsOnlyRealFailures(t *testing.T) {
	reset := &net.OpError{Op: "read", Net: "tcp", Err: os.NewSyscallError("read", syscall.ECONNRESET)}
	dialFailed := &tunnelcore.PeerError{Code: tunnelpb.Error_DIAL_FAILED, Message: "connection refused"}
	sessionEnded := fmt.Errorf("%w: %w", tunnelcore.ErrSessionClosed, io.EOF)
	tests := []struct {
		name string
		err  error
		want error // nil: Handle returns nil
	}{
		{"clean end", nil, nil},
		{"client reset", reset, nil},
		{"client broken pipe", fmt.Errorf("write: %w", syscall.EPIPE), nil},
		{"client closed", net.ErrClosed, nil},
		{"idle timeout", os.ErrDeadlineExceeded, nil},
		{"not allowed", caddymodule.ErrForbidden, nil},
		{"limit", caddymodule.ErrLimit, nil},
		{"no route", caddymodule.ErrNoRoute, nil},
		{"agent could not dial", dialFailed, dialFailed},
		{"session ended", tunnelcore.ErrSessionClosed, tunnelcore.ErrSessionClosed},
		{"session ended by the stream's EOF", sessionEnded, tunnelcore.ErrSessionClosed},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			h, _ := testHandler("redis", tt.err)
			got := handle(t, h)
			switch {
			case tt.want == nil && got != nil:
				t.Fatalf("Handle = %v, want nil", got)
			case tt.want != nil && !errors.Is(got, tt.want):
				t.Fatalf("Handle = %v, want it to wrap %v", got, tt.want)
			case tt.want != nil && !strings.Contains(got.Error(), `route "redis"`):
				t.Fatalf("Handle = %v: no route in it", got)
			}
		})
	}
}

// TestHandleLogsNoRouteThrottled: a connection no agent serves is logged
// at WARN, at most once per throttle interval, and not returned.
func TestHandleLogsNoRouteThrottled(t *testing.T) {
	h, logs := testHandler("", caddymodule.ErrNoRoute)
	for range 3 {
		if err := handle(t, h); err != nil {
			t.Fatalf("Handle = %v", err)
		}
	}
	if got := logs.FilterMessage("no agent serves connection; closed").All(); len(got) != 1 || got[0].Level != zapcore.WarnLevel {
		t.Fatalf("logged %v, want one WARN", got)
	}
}

// handle runs h.Handle on a fresh TCP connection.
func handle(t *testing.T, h *Handler) error {
	t.Helper()
	_, server := testnet.TCPPair(t)
	return h.Handle(layer4.WrapConnection(server, nil, zap.NewNop()), nil)
}

// TestHandleUDPPicksTheRoute: on a UDP server the handler carries the
// client's datagrams (RelayUDP), by the route name it is configured with,
// else by the port the client sent to, and a refusal is not returned.
func TestHandleUDPPicksTheRoute(t *testing.T) {
	for _, route := range []string{"dns", ""} {
		var got caddymodule.UDPTarget
		h, _ := testHandler(route, errors.New("the TCP relay must not run"))
		h.relayUDP = func(_ net.Conn, target caddymodule.UDPTarget) error {
			got = target
			return caddymodule.ErrNoRoute
		}
		server, port := udpConnPair(t)
		if err := h.Handle(layer4.WrapConnection(server, nil, zap.NewNop()), nil); err != nil {
			t.Fatalf("route %q: Handle = %v", route, err)
		}
		if got.Route != route || got.LocalPort != uint32(port) {
			t.Errorf("route %q: relayed to %+v, want route %q, port %d", route, got, route, port)
		}
	}
}

// TestUDPConnCloseEndsReadsOnly: the relay's Close of a UDP server's
// connection ends its reads, and leaves the close to caddy-l4.
func TestUDPConnCloseEndsReadsOnly(t *testing.T) {
	server, _ := udpConnPair(t)
	c := udpConn{server}
	if err := c.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Read(make([]byte, 10)); !errors.Is(err, os.ErrDeadlineExceeded) {
		t.Fatalf("read after Close: %v, want the deadline", err)
	}
	if _, err := server.Write([]byte("still open")); err != nil {
		t.Fatalf("write after Close: %v", err)
	}
}

// udpConnPair returns a UDP socket connected to a client socket, as a
// UDP server's connection for one client address stands, and its port.
func udpConnPair(t *testing.T) (net.Conn, int) {
	t.Helper()
	client, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { client.Close() })
	server, err := net.DialUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)}, client.LocalAddr().(*net.UDPAddr))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { server.Close() })
	return server, server.LocalAddr().(*net.UDPAddr).Port
}

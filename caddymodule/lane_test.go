package caddymodule

import (
	"errors"
	"io"
	"net"
	"testing"
	"time"

	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func TestLaneTicketsAreGoodOnce(t *testing.T) {
	var tickets laneTickets
	ticket, lanes, withdraw := tickets.offer()
	if len(ticket) != tunnelpb.LaneTicketLength {
		t.Fatalf("ticket %q: %d characters, want %d", ticket, len(ticket), tunnelpb.LaneTicketLength)
	}
	other, _, withdrawOther := tickets.offer()
	defer withdrawOther()
	if other == ticket {
		t.Fatal("two offers share a ticket")
	}
	a, b := net.Pipe()
	defer b.Close()
	yes := func() bool { return true }
	if tickets.claim("0123456789abcdef0123456789abcdef", a, yes) {
		t.Fatal("an unknown ticket was claimed")
	}
	// A connection the guard closed as it presented the ticket is not
	// handed over, and the ticket waits for the agent's next try.
	if tickets.claim(ticket, a, func() bool { return false }) {
		t.Fatal("a lane the guard refused was claimed")
	}
	if !tickets.claim(ticket, a, yes) {
		t.Fatal("the offered ticket was not claimed")
	}
	if got := receiveLane(t, lanes); got != a {
		t.Fatal("the claimed lane did not reach the offer")
	}
	if tickets.claim(ticket, a, yes) {
		t.Fatal("a ticket was claimed twice")
	}
	withdraw()
}

// TestLaneWithdrawClosesAnUntakenLane: a lane that claimed its ticket while
// the stream gave the offer up is closed, not left open.
func TestLaneWithdrawClosesAnUntakenLane(t *testing.T) {
	var tickets laneTickets
	ticket, _, withdraw := tickets.offer()
	a, b := net.Pipe()
	defer b.Close()
	if !tickets.claim(ticket, a, func() bool { return true }) {
		t.Fatal("claim failed")
	}
	withdraw()
	b.SetReadDeadline(time.Now().Add(5 * time.Second))
	if _, err := b.Read(make([]byte, 1)); !errors.Is(err, io.EOF) {
		t.Fatalf("the untaken lane was not closed: %v", err)
	}
}

// receiveLane waits a bounded time for the lane an offer was given.
func receiveLane(t *testing.T, lanes <-chan net.Conn) net.Conn {
	t.Helper()
	select {
	case c := <-lanes:
		return c
	case <-time.After(5 * time.Second):
		t.Fatal("no lane reached the offer")
		return nil
	}
}

// laneHandshake runs laneCreds' server side over a pipe whose client writes
// hello first; the pipe's deadline bounds it, as gRPC's connection timeout
// bounds a real handshake.
func laneHandshake(t *testing.T, c *laneCreds, hello string) (net.Conn, net.Conn, error) {
	t.Helper()
	server, client := net.Pipe()
	server.SetDeadline(time.Now().Add(5 * time.Second))
	t.Cleanup(func() { server.Close(); client.Close() })
	go client.Write([]byte(hello))
	conn, _, err := c.ServerHandshake(server)
	return conn, client, err
}

func TestLaneCredsSplitLanesFromGRPC(t *testing.T) {
	tickets := &laneTickets{}
	var refused []error
	c := &laneCreds{TransportCredentials: insecure.NewCredentials(), tickets: tickets,
		direct: &directKeys{}, refused: func(_ net.Addr, _ string, err error) { refused = append(refused, err) }}

	t.Run("gRPC gets every byte", func(t *testing.T) {
		preface := "PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
		conn, _, err := laneHandshake(t, c, preface)
		if err != nil {
			t.Fatal(err)
		}
		conn.SetReadDeadline(time.Now().Add(5 * time.Second))
		got := make([]byte, len(preface))
		if _, err := io.ReadFull(conn, got); err != nil || string(got) != preface {
			t.Fatalf("gRPC read %q, %v", got, err)
		}
	})
	t.Run("a lane with its ticket leaves gRPC", func(t *testing.T) {
		ticket, lanes, withdraw := tickets.offer()
		defer withdraw()
		_, _, err := laneHandshake(t, c, string(tunnelpb.LaneHello(ticket))+"after")
		if !errors.Is(err, credentials.ErrConnDispatched) {
			t.Fatalf("err %v, want ErrConnDispatched", err)
		}
		lane := receiveLane(t, lanes)
		lane.SetReadDeadline(time.Now().Add(5 * time.Second))
		got := make([]byte, 5)
		if _, err := io.ReadFull(lane, got); err != nil || string(got) != "after" {
			t.Fatalf("the lane read %q, %v: the preface must be all it consumed", got, err)
		}
	})
	for _, tc := range []struct{ name, hello string }{
		{"an unknown ticket", string(tunnelpb.LaneHello("ffffffffffffffffffffffffffffffff"))},
		{"a malformed preface", "SLUICE-LANE/9 ffffffffffffffffffffffffffffffff\n"},
		{"a short preface", "SLUICE"},
	} {
		t.Run(tc.name+" is closed", func(t *testing.T) {
			before := len(refused)
			server, client := net.Pipe()
			defer client.Close()
			server.SetDeadline(time.Now().Add(5 * time.Second))
			go func() {
				client.Write([]byte(tc.hello))
				if tc.hello == "SLUICE" {
					client.Close()
				}
			}()
			_, _, err := c.ServerHandshake(server)
			if !errors.Is(err, credentials.ErrConnDispatched) {
				t.Fatalf("err %v, want ErrConnDispatched (gRPC must not answer it)", err)
			}
			if len(refused) != before+1 {
				t.Fatalf("refusals logged: %d, want %d", len(refused)-before, 1)
			}
			client.SetReadDeadline(time.Now().Add(5 * time.Second))
			if n, err := client.Read(make([]byte, 1)); err == nil {
				t.Fatalf("the stranger read %d bytes; want the connection closed", n)
			}
		})
	}
}

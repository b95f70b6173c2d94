package agent

import (
	"context"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"
)

// streamWithContext is a ClientStream that has only a context.
type streamWithContext struct {
	grpc.ClientStream
	ctx context.Context
}

func (s streamWithContext) Context() context.Context { return s.ctx }

// TestLaneGoesWhereTheStreamIs: the lane is dialed to the address the
// Connect stream is connected to, not to the server name resolved again
// (which, with several addresses, may name another node).
func TestLaneGoesWhereTheStreamIs(t *testing.T) {
	connected := &net.TCPAddr{IP: net.ParseIP("192.0.2.7"), Port: 8001}
	st := streamWithContext{ctx: peer.NewContext(context.Background(), &peer.Peer{Addr: connected})}
	if got := laneAddr(st, "nodes.example.com:8001"); got != "192.0.2.7:8001" {
		t.Errorf("lane address %q, want the stream's peer 192.0.2.7:8001", got)
	}
	if got := laneAddr(streamWithContext{ctx: context.Background()}, "nodes.example.com:8001"); got != "nodes.example.com:8001" {
		t.Errorf("without a known peer: lane address %q, want the server's host:port", got)
	}
}

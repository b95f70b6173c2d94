package tunnelcore

import (
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/peer"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// slowPeer takes one frame from b every interval, n frames in all, and
// grants DATA credit back; it reports how many it took.
func slowPeer(b FrameStream, interval time.Duration, n int, stop <-chan struct{}) <-chan int {
	took := make(chan int, 1)
	go func() {
		i := 0
		defer func() { took <- i }()
		for ; i < n; i++ {
			select {
			case <-stop:
				return
			case <-time.After(interval):
			}
			env := &tunnelpb.Envelope{}
			if b.Recv(env) != nil {
				return
			}
			if env.IsData() {
				size := env.Payload.Len()
				env.Payload.Free()
				b.Send(&tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
					WindowUpdate: &tunnelpb.WindowUpdate{ConnId: env.ConnID, Increment: uint32(size)}}}})
			}
		}
	}()
	return took
}

// TestStallWatchdogSparesASlowLink: each frame takes three stall timeouts
// to go through, but the transport keeps delivering bytes (a slow link, as
// Config.Progress reports it): the session is not cut.
func TestStallWatchdogSparesASlowLink(t *testing.T) {
	a, b := Pipe(1)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	start := time.Now()
	link := func() uint64 { return uint64(time.Since(start).Microseconds()) } // ~1 MB/s
	node, err := NewSession(a, Config{Role: RoleNode, StallTimeout: 100 * time.Millisecond, Progress: link})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	stop := make(chan struct{})
	defer close(stop)
	const frames = 5
	took := slowPeer(b, 300*time.Millisecond, frames, stop)
	c, _ := node.Open(ConnectInfo{})
	go c.Write(make([]byte, 1<<20)) // more frames than the pipe holds: Send blocks

	select {
	case n := <-took:
		if n != frames {
			t.Fatalf("the peer took %d frames of %d: %v", n, frames, node.Err())
		}
	case <-node.Done():
		t.Fatalf("a slow link was cut: %v", node.Err())
	case <-time.After(10 * time.Second):
		t.Fatal("the slow peer did not finish")
	}
	if err := node.Err(); err != nil {
		t.Fatalf("session failed: %v", err)
	}
}

// TestStallWatchdogIgnoresKeepaliveProgress: the peer takes nothing while
// the transport moves a few bytes now and then (keepalive pings, window
// updates): below one frame per stall timeout, that is no progress.
func TestStallWatchdogIgnoresKeepaliveProgress(t *testing.T) {
	a, b := Pipe(1)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	var pings atomic.Uint64
	trickle := func() uint64 { return pings.Add(17) } // a ping's worth per look
	node, err := NewSession(a, Config{Role: RoleNode, StallTimeout: 100 * time.Millisecond, Progress: trickle})
	if err != nil {
		t.Fatal(err)
	}
	c, _ := node.Open(ConnectInfo{})
	go c.Write(make([]byte, 1<<20))
	select {
	case <-node.Done():
	case <-time.After(5 * time.Second):
		t.Fatal("a stalled stream was not cut")
	}
	if !errors.Is(node.Err(), ErrStalled) {
		t.Fatalf("session ended with %v, want ErrStalled", node.Err())
	}
}

// TestProgressCredentialsReadTheSocket: over real gRPC on loopback, the
// server finds a progress reader in the stream's peer AuthInfo, the client
// in its credentials, and both count at least the bytes a session moved.
func TestProgressCredentialsReadTheSocket(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_INFO progress is linux-only")
	}
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(ProgressCredentials(nil)), grpc.ForceServerCodecV2(tunnelpb.Codec{}))
	ts := &progressServer{streams: make(chan serverSide, 1)}
	tunnelpb.RegisterTunnelServer(srv, ts)
	go srv.Serve(lis)
	defer srv.Stop()

	creds := ProgressCredentials(nil)
	cc, err := grpc.NewClient(lis.Addr().String(), grpc.WithTransportCredentials(creds),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var server serverSide
	select {
	case server = <-ts.streams:
	case <-time.After(5 * time.Second):
		t.Fatal("server never saw the stream")
	}
	defer server.stream.Close(nil)
	if server.progress == nil {
		t.Fatal("no progress reader in the server stream's AuthInfo")
	}
	clientProgress := creds.Progress()

	node, err := NewSession(server.stream, Config{Role: RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	agent, err := NewSession(GRPCStream(st, cancel), Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()

	const size = 1 << 20
	serverBefore, clientBefore := server.progress(), clientProgress()
	c, _ := node.Open(ConnectInfo{})
	go func() { c.Write(make([]byte, size)); c.CloseWrite() }()
	ac := accept(t, agent)
	go func() { ac.Write(make([]byte, size)); ac.CloseWrite() }()
	if n, err := drain(ac); err != nil || n != size {
		t.Fatalf("agent read %d, %v", n, err)
	}
	if n, err := drain(c); err != nil || n != size {
		t.Fatalf("node read %d, %v", n, err)
	}
	if got := server.progress() - serverBefore; got < size {
		t.Errorf("server progress moved %d bytes, want at least %d", got, size)
	}
	if got := clientProgress() - clientBefore; got < size {
		t.Errorf("client progress moved %d bytes, want at least %d", got, size)
	}
	c.Close()
	ac.Close()
}

func drain(c *Conn) (int, error) {
	buf := make([]byte, 64<<10)
	total := 0
	for {
		n, err := c.Read(buf)
		total += n
		if err != nil {
			if errors.Is(err, io.EOF) {
				return total, nil
			}
			return total, err
		}
	}
}

type serverSide struct {
	stream   FrameStream
	progress func() uint64
}

type progressServer struct {
	tunnelpb.UnimplementedTunnelServer
	streams chan serverSide
}

func (s *progressServer) Connect(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	ctx, cancel := context.WithCancel(st.Context())
	var progress func() uint64
	if p, ok := peer.FromContext(ctx); ok {
		progress = ProgressOf(p.AuthInfo)
	}
	s.streams <- serverSide{stream: GRPCStream(st, cancel), progress: progress}
	<-ctx.Done()
	return nil
}

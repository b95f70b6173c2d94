package tunnelcore

import (
	"context"
	"errors"
	"io"
	"net"
	"runtime"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
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

// linkAt returns a Config.Progress that delivers rate bytes a second.
func linkAt(rate float64) func() uint64 {
	start := time.Now()
	return func() uint64 { return uint64(time.Since(start).Seconds() * rate) }
}

// stepsPerTimeout is the rate at which a link delivers k watchdog steps
// (stallProgressStep) per stall timeout st.
func stepsPerTimeout(k float64, st time.Duration) float64 {
	return k * stallProgressStep / st.Seconds()
}

// TestStallWatchdogSparesASlowLink: each frame takes three stall timeouts
// to go through, but the transport keeps delivering bytes, four watchdog
// steps per timeout (a slow link, as Config.Progress reports it): the
// session is not cut. Without Progress the same session is cut.
func TestStallWatchdogSparesASlowLink(t *testing.T) {
	const st = 100 * time.Millisecond
	for _, tc := range []struct {
		name     string
		progress func() uint64
		wantCut  bool
	}{
		{"with progress", linkAt(stepsPerTimeout(4, st)), false},
		{"without progress", nil, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			a, b := Pipe(1)
			t.Cleanup(func() { a.Close(nil); b.Close(nil) })
			node, err := NewSession(a, Config{Role: RoleNode, StallTimeout: st, Progress: tc.progress})
			if err != nil {
				t.Fatal(err)
			}
			defer node.Close()
			stop := make(chan struct{})
			defer close(stop)
			const frames = 5
			took := slowPeer(b, 3*st, frames, stop)
			c, _ := node.Open(ConnectInfo{})
			go c.Write(make([]byte, 1<<20)) // more frames than the pipe holds: Send blocks

			select {
			case n := <-took:
				if tc.wantCut {
					t.Fatalf("the peer took all %d frames; want the session cut", n)
				}
				if n != frames {
					t.Fatalf("the peer took %d frames of %d: %v", n, frames, node.Err())
				}
			case <-node.Done():
				if !tc.wantCut {
					t.Fatalf("a slow link was cut: %v", node.Err())
				}
				if !errors.Is(node.Err(), ErrStalled) {
					t.Fatalf("session ended with %v, want ErrStalled", node.Err())
				}
				return
			case <-time.After(10 * time.Second):
				t.Fatal("the slow peer did not finish")
			}
			if err := node.Err(); err != nil {
				t.Fatalf("session failed: %v", err)
			}
		})
	}
}

// TestStallWatchdogCutsBelowOneStepPerTimeout: the peer takes nothing while
// the transport trickles a quarter of a watchdog step per stall timeout
// (keepalive pings, window updates): that is no progress, and the session
// is cut.
func TestStallWatchdogCutsBelowOneStepPerTimeout(t *testing.T) {
	const st = 100 * time.Millisecond
	a, b := Pipe(1)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	node, err := NewSession(a, Config{Role: RoleNode, StallTimeout: st, Progress: linkAt(stepsPerTimeout(0.25, st))})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	c, _ := node.Open(ConnectInfo{})
	go c.Write(make([]byte, 1<<20))
	waitStalled(t, node, 5*time.Second)
}

// progressPair connects a gRPC client and server on loopback, both with
// ProgressCredentials and the tunnel's static windows, and returns each
// end's stream and the progress reader found in its stream's context.
func progressPair(t *testing.T) (server, client FrameStream, serverProgress, clientProgress func() uint64) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(grpc.Creds(ProgressCredentials(insecure.NewCredentials())),
		grpc.ForceServerCodecV2(tunnelpb.Codec{}),
		grpc.InitialWindowSize(GRPCWindowSize), grpc.InitialConnWindowSize(GRPCWindowSize))
	ts := &progressServer{streams: make(chan serverSide, 1)}
	tunnelpb.RegisterTunnelServer(srv, ts)
	go srv.Serve(lis)
	t.Cleanup(srv.Stop)

	cc, err := grpc.NewClient(lis.Addr().String(),
		grpc.WithTransportCredentials(ProgressCredentials(insecure.NewCredentials())),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})),
		grpc.WithInitialWindowSize(GRPCWindowSize), grpc.WithInitialConnWindowSize(GRPCWindowSize))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if p, ok := peer.FromContext(st.Context()); ok {
		clientProgress = ProgressOf(p.AuthInfo)
	}
	var ss serverSide
	select {
	case ss = <-ts.streams:
	case <-time.After(5 * time.Second):
		t.Fatal("server never saw the stream")
	}
	t.Cleanup(func() { ss.stream.Close(nil) })
	return ss.stream, GRPCStream(st, cancel), ss.progress, clientProgress
}

// TestStallWatchdogCutsARealStall: over real gRPC on loopback, with the
// socket's progress, a peer that stops reading the stream is still cut once
// the stream window and the socket buffers are full.
func TestStallWatchdogCutsARealStall(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_INFO progress is linux-only")
	}
	server, client, serverProgress, _ := progressPair(t)
	if serverProgress == nil {
		t.Fatal("no progress reader on the server side")
	}
	node, err := NewSession(server, Config{Role: RoleNode, StallTimeout: time.Second, Progress: serverProgress})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	c, _ := node.Open(ConnectInfo{})
	// The raw peer takes the Connect, grants a large window, then reads
	// nothing more.
	env := &tunnelpb.Envelope{}
	if err := client.Recv(env); err != nil || env.Frame.GetConnect() == nil {
		t.Fatalf("first frame: %v %v", env.Frame, err)
	}
	client.Send(&tunnelpb.Envelope{Frame: &tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{
		WindowUpdate: &tunnelpb.WindowUpdate{ConnId: env.Frame.GetConnect().GetConnId(), Increment: 1 << 30}}}})
	go func() {
		buf := make([]byte, 1<<20)
		for {
			if _, err := c.Write(buf); err != nil {
				return
			}
		}
	}()
	waitStalled(t, node, 20*time.Second)
}

// waitStalled waits (bounded) for node to end and checks it was cut by the
// stall watchdog.
func waitStalled(t *testing.T, node *Session, within time.Duration) {
	t.Helper()
	select {
	case <-node.Done():
	case <-time.After(within):
		t.Fatalf("a stalled stream was not cut within %v", within)
	}
	if !errors.Is(node.Err(), ErrStalled) {
		t.Fatalf("session ended with %v, want ErrStalled", node.Err())
	}
}

// TestProgressCredentialsReadTheSocket: over real gRPC on loopback, each
// end finds a progress reader in its stream's peer AuthInfo, and both count
// at least the bytes a session moved.
func TestProgressCredentialsReadTheSocket(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("TCP_INFO progress is linux-only")
	}
	server, client, serverProgress, clientProgress := progressPair(t)
	if serverProgress == nil || clientProgress == nil {
		t.Fatalf("progress readers: server %v, client %v", serverProgress != nil, clientProgress != nil)
	}
	node, err := NewSession(server, Config{Role: RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	defer node.Close()
	agent, err := NewSession(client, Config{Role: RoleAgent})
	if err != nil {
		t.Fatal(err)
	}
	defer agent.Close()

	const size = 1 << 20
	serverBefore, clientBefore := serverProgress(), clientProgress()
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
	if got := serverProgress() - serverBefore; got < size {
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

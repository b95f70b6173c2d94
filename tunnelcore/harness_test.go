package tunnelcore

import (
	"context"
	"net"
	"os"
	"strconv"
	"testing"
	"time"

	"go.uber.org/goleak"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/experimental"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// transport makes a connected pair of frame streams; the returned cleanup
// releases whatever the transport started.
type transport struct {
	name string
	pair func(t testing.TB) (node, agent FrameStream)
}

var transports = []transport{
	{"pipe", pipePair},
	{"grpc", grpcPair},
	{"lane", lanePair},
}

// lanePair connects two ConnStreams over a loopback TCP connection, the
// data lane's transport.
func lanePair(t testing.TB) (FrameStream, FrameStream) {
	client, server := tcpPair(t)
	a, b := ConnStream(server), ConnStream(client)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	return a, b
}

// tcpPair returns both ends of a loopback TCP connection.
func tcpPair(t testing.TB) (*net.TCPConn, *net.TCPConn) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer lis.Close()
	accepted := make(chan net.Conn, 1)
	go func() {
		c, _ := lis.Accept()
		accepted <- c
	}()
	a, err := net.Dial("tcp", lis.Addr().String())
	if err != nil {
		t.Fatal(err)
	}
	var b net.Conn
	select {
	case b = <-accepted:
	case <-time.After(5 * time.Second):
		t.Fatal("accept timed out")
	}
	if b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	return a.(*net.TCPConn), b.(*net.TCPConn)
}

func pipePair(t testing.TB) (FrameStream, FrameStream) {
	a, b := Pipe(64)
	t.Cleanup(func() { a.Close(nil); b.Close(nil) })
	return a, b
}

// tunnelServer serves Connect by handing each stream to the test.
type tunnelServer struct {
	tunnelpb.UnimplementedTunnelServer
	streams chan FrameStream
}

func (s *tunnelServer) Connect(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	ctx, cancel := context.WithCancel(st.Context())
	s.streams <- GRPCStream(st, cancel)
	<-ctx.Done()
	return nil
}

// grpcPair runs a real gRPC server on loopback and connects a client to it.
func grpcPair(t testing.TB) (FrameStream, FrameStream) {
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(append(benchServerOpts(), grpc.ForceServerCodecV2(tunnelpb.Codec{}), experimental.BufferPool(BufferPool()))...)
	ts := &tunnelServer{streams: make(chan FrameStream, 1)}
	tunnelpb.RegisterTunnelServer(srv, ts)
	go srv.Serve(lis)

	cc, err := grpc.NewClient(lis.Addr().String(), append(benchDialOpts(),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})),
		experimental.WithBufferPool(BufferPool()))...)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		t.Fatal(err)
	}
	client := GRPCStream(st, cancel)
	var server FrameStream
	select {
	case server = <-ts.streams:
	case <-time.After(5 * time.Second):
		t.Fatal("server never saw the stream")
	}
	t.Cleanup(func() {
		cancel()
		server.Close(nil)
		cc.Close()
		srv.Stop()
	})
	return server, client
}

// sessionPair starts a node session and an agent session on a transport.
func sessionPair(t testing.TB, tr transport, nodeCfg, agentCfg Config) (node, agent *Session) {
	a, b := tr.pair(t)
	nodeCfg.Role, agentCfg.Role = RoleNode, RoleAgent
	node, err := NewSession(a, nodeCfg)
	if err != nil {
		t.Fatal(err)
	}
	agent, err = NewSession(b, agentCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		node.Close()
		agent.Close()
	})
	return node, agent
}

// forEachTransport runs body once per transport, as yamux runs its tests
// over pipes, TCP and TLS.
func forEachTransport(t *testing.T, body func(t *testing.T, tr transport)) {
	for _, tr := range transports {
		t.Run(tr.name, func(t *testing.T) { body(t, tr) })
	}
}

// eventually polls cond until it holds or within passes.
var eventually = testwait.Until

func accept(t testing.TB, s *Session) *Conn {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := s.Accept(ctx)
	if err != nil {
		t.Fatalf("accept: %v", err)
	}
	return c
}

func envInt(name string) int {
	v, _ := strconv.Atoi(os.Getenv(name))
	return v
}

// benchSizes are the gRPC buffer and window sizes of the test transports:
// the production ones, or WB / WIN from the environment.
func benchSizes() (buf, win int) {
	buf, win = GRPCBufferSize, GRPCWindowSize
	if n := envInt("WB"); n > 0 {
		buf = n
	}
	if n := envInt("WIN"); n > 0 {
		win = n
	}
	return buf, win
}

func benchServerOpts() []grpc.ServerOption {
	buf, win := benchSizes()
	return []grpc.ServerOption{grpc.WriteBufferSize(buf), grpc.ReadBufferSize(buf),
		grpc.InitialWindowSize(int32(win)), grpc.InitialConnWindowSize(int32(win))}
}

func benchDialOpts() []grpc.DialOption {
	buf, win := benchSizes()
	return []grpc.DialOption{grpc.WithWriteBufferSize(buf), grpc.WithReadBufferSize(buf),
		grpc.WithInitialWindowSize(int32(win)), grpc.WithInitialConnWindowSize(int32(win))}
}

package agent

import (
	"cmp"
	"context"
	"errors"
	"net"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/keepalive"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m)
}

// fakeNode is a minimal sluice node: a real gRPC server on loopback that
// checks the token, reads the Advertise raw, starts a node session, answers
// with an AdvertiseAck and hands the session to the test.
type fakeNode struct {
	tunnelpb.UnimplementedTunnelServer

	t     testing.TB
	token string
	addr  string
	id    string // node id in the acks; default node-1
	srv   *grpc.Server
	// membership, when set, is sent after the first ack of every session.
	membership func() *tunnelpb.MembershipUpdate

	// ack builds the AdvertiseAck for the n-th Advertise (n from 1) of a
	// session; nil accepts every route. Returning nil sends no Ack.
	ack    func(adv *tunnelpb.Advertise, n int) *tunnelpb.AdvertiseAck
	silent bool // nodeOptions.silentOnDrain

	attempts    atomic.Int32 // Connect calls
	authFailed  atomic.Int32 // Connect calls refused for the token
	sessions    chan *nodeSession
	stopOnce    sync.Once
	handlersEnd sync.WaitGroup
}

// nodeSession is one agent session as the fake node sees it.
type nodeSession struct {
	sess   *tunnelcore.Session
	adv    *tunnelpb.Advertise
	md     metadata.MD
	peer   *peer.Peer // the stream's: its AuthInfo tells the TLS state
	cancel context.CancelFunc
	// advs receives every later Advertise of the session.
	advs chan *tunnelpb.Advertise
	// drains receives the Drain frames the agent sends when it leaves.
	drains chan *tunnelpb.Drain
}

type nodeOptions struct {
	addr string       // default 127.0.0.1:0
	lis  net.Listener // listens there instead of addr
	id   string       // node id; default node-1
	// membership, when set, is sent after the first ack of every session.
	membership func() *tunnelpb.MembershipUpdate
	creds      credentials.TransportCredentials
	ack        func(adv *tunnelpb.Advertise, n int) *tunnelpb.AdvertiseAck
	// silentOnDrain leaves an agent's Drain unanswered, as nodes that
	// predate it do; otherwise the node answers with an empty AdvertiseAck.
	silentOnDrain bool
}

func newFakeNode(t testing.TB, token string, o nodeOptions) *fakeNode {
	t.Helper()
	addr := o.addr
	if addr == "" {
		addr = "127.0.0.1:0"
	}
	lis := o.lis
	var err error
	// A restarted node rebinds the port its predecessor released.
	deadline := time.Now().Add(5 * time.Second)
	for lis == nil {
		lis, err = net.Listen("tcp", addr)
		if err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err != nil {
		t.Fatal(err)
	}
	opts := []grpc.ServerOption{
		grpc.ForceServerCodecV2(tunnelpb.Codec{}),
		grpc.KeepaliveEnforcementPolicy(keepalive.EnforcementPolicy{MinTime: 10 * time.Second, PermitWithoutStream: true}),
	}
	if o.creds != nil {
		opts = append(opts, grpc.Creds(o.creds))
	}
	n := &fakeNode{
		t:          t,
		token:      token,
		addr:       lis.Addr().String(),
		id:         cmp.Or(o.id, "node-1"),
		membership: o.membership,
		srv:        grpc.NewServer(opts...),
		ack:        o.ack,
		silent:     o.silentOnDrain,
		sessions:   make(chan *nodeSession, 16),
	}
	tunnelpb.RegisterTunnelServer(n.srv, n)
	go n.srv.Serve(lis)
	t.Cleanup(n.stop)
	return n
}

func (n *fakeNode) stop() {
	n.stopOnce.Do(func() {
		n.srv.Stop()
		n.handlersEnd.Wait()
	})
}

func (n *fakeNode) Connect(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) error {
	n.handlersEnd.Add(1)
	defer n.handlersEnd.Done()
	n.attempts.Add(1)
	md, _ := metadata.FromIncomingContext(st.Context())
	// A node without a token takes agents without one (a client
	// certificate authenticates them).
	if got := md.Get("authorization"); n.token == "" && len(got) != 0 || n.token != "" && (len(got) != 1 || got[0] != "Bearer "+n.token) {
		n.authFailed.Add(1)
		return status.Error(codes.Unauthenticated, "invalid token")
	}
	adv, err := awaitAdvertise(st)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(st.Context())
	defer cancel()
	p, _ := peer.FromContext(st.Context())
	ns := &nodeSession{adv: adv, md: md, peer: p, cancel: cancel, advs: make(chan *tunnelpb.Advertise, 16), drains: make(chan *tunnelpb.Drain, 4)}
	var advN atomic.Int32
	advN.Store(1)
	var sess *tunnelcore.Session
	ready := make(chan struct{})
	sess, err = tunnelcore.NewSession(tunnelcore.GRPCStream(st, cancel), tunnelcore.Config{
		Role:       tunnelcore.RoleNode,
		PeerWindow: adv.GetInitialWindow(),
		OnControl: func(f *tunnelpb.Frame) {
			if d := f.GetDrain(); d != nil {
				select {
				case ns.drains <- d:
				default:
				}
				if !n.silent {
					go func() { // OnControl must not block
						<-ready
						sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: &tunnelpb.AdvertiseAck{NodeId: n.id}}})
						// As the node does: end the session once no
						// connection is left (bounded by the test).
						for sess.NumConns() > 0 && ctx.Err() == nil {
							time.Sleep(5 * time.Millisecond)
						}
						sess.Flush(ctx) // the answer first
						cancel()
					}()
				}
			}
			if a := f.GetAdvertise(); a != nil {
				select {
				case ns.advs <- a:
				default:
				}
				k := int(advN.Add(1))
				go func() { // OnControl must not block
					<-ready
					n.sendAck(sess, a, k)
				}()
			}
		},
	})
	if err != nil {
		return err
	}
	close(ready)
	defer sess.Close()
	ns.sess = sess
	n.sendAck(sess, adv, 1)
	if n.membership != nil {
		sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_MembershipUpdate{MembershipUpdate: n.membership()}})
	}
	select {
	case n.sessions <- ns:
	case <-ctx.Done():
		return nil
	}
	select {
	case <-ctx.Done():
	case <-sess.Done():
	}
	return nil
}

func (n *fakeNode) sendAck(sess *tunnelcore.Session, adv *tunnelpb.Advertise, k int) {
	var ack *tunnelpb.AdvertiseAck
	if n.ack != nil {
		ack = n.ack(adv, k)
	} else {
		ack = acceptAll(adv)
		ack.NodeId = n.id
	}
	if ack != nil {
		sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_AdvertiseAck{AdvertiseAck: ack}})
	}
}

func acceptAll(adv *tunnelpb.Advertise) *tunnelpb.AdvertiseAck {
	ack := &tunnelpb.AdvertiseAck{NodeId: "node-1", InitialWindow: tunnelcore.InitialWindow}
	for _, r := range adv.GetRoutes() {
		ack.Accepted = append(ack.Accepted, &tunnelpb.RouteKey{Name: r.GetName()})
	}
	return ack
}

// next waits for the next session an agent established.
func (n *fakeNode) next(t testing.TB) *nodeSession {
	t.Helper()
	select {
	case ns := <-n.sessions:
		return ns
	case <-time.After(10 * time.Second):
		t.Fatal("timed out waiting for an agent session")
		return nil
	}
}

// runningAgent is an Agent started by startAgent.
type runningAgent struct {
	*Agent
	logs   *observer.ObservedLogs
	cancel context.CancelFunc
	done   chan error
}

// stop cancels the agent and waits for Run; it returns Run's result.
func (r *runningAgent) stop(t testing.TB) error {
	t.Helper()
	r.cancel()
	select {
	case err := <-r.done:
		r.done <- err
		return err
	case <-time.After(10 * time.Second):
		t.Fatal("Run did not return within 10s of cancel")
		return nil
	}
}

// testConfig is an agent configuration for the node at addr.
func testConfig(addr, token string, ups ...Upstream) *Config {
	return &Config{Server: "grpc://" + addr, Token: token, ID: "agent-test", Upstreams: ups}
}

// startAgent runs an agent for cfg with a fast backoff; it is stopped at cleanup.
func startAgent(t testing.TB, cfg *Config, tweak ...func(*Agent)) *runningAgent {
	t.Helper()
	return startAgentWith(t, cfg, nil, tweak...)
}

// startAgentWith is startAgent with options for New besides the backoff.
func startAgentWith(t testing.TB, cfg *Config, opts []Option, tweak ...func(*Agent)) *runningAgent {
	t.Helper()
	core, logs := observer.New(zap.DebugLevel)
	opts = append([]Option{WithBackoff(20*time.Millisecond, 200*time.Millisecond)}, opts...)
	a, err := New(cfg, zap.New(core), opts...)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range tweak {
		f(a)
	}
	ctx, cancel := context.WithCancel(context.Background())
	r := &runningAgent{Agent: a, logs: logs, cancel: cancel, done: make(chan error, 1)}
	go func() { r.done <- a.Run(ctx) }()
	t.Cleanup(func() {
		if err := r.stop(t); err != nil {
			t.Errorf("Run: %v", err)
		}
		if t.Failed() {
			for _, e := range logs.All() {
				t.Logf("agent log: %s %s %v", e.Level, e.Message, e.ContextMap())
			}
		}
	})
	return r
}

// waitFor polls cond until it holds or within passes.
var waitFor = testwait.Until

// hasLog reports whether the agent logged a message starting with msg whose
// string field contains contains (any such message when field is "").
func hasLog(logs *observer.ObservedLogs, msg string, field, contains string) bool {
	for _, e := range logs.All() {
		if !strings.HasPrefix(e.Message, msg) {
			continue
		}
		if field == "" {
			return true
		}
		if v, ok := e.ContextMap()[field].(string); ok && strings.Contains(v, contains) {
			return true
		}
	}
	return false
}

// peerError reads from c until it fails and returns the PeerError.
func peerError(t testing.TB, c net.Conn) *tunnelcore.PeerError {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	buf := make([]byte, 1024)
	for {
		_, err := c.Read(buf)
		if err == nil {
			continue
		}
		var pe *tunnelcore.PeerError
		if !errors.As(err, &pe) {
			t.Fatalf("read error %v (%T) is not a PeerError", err, err)
		}
		return pe
	}
}

// awaitAdvertise answers a Connect stream as a node does before the
// Advertise: its response header (proto/README §2.4; no data lane
// offered), then the first frame, which must be the Advertise.
func awaitAdvertise(st grpc.BidiStreamingServer[tunnelpb.Frame, tunnelpb.Frame]) (*tunnelpb.Advertise, error) {
	if err := st.SendHeader(metadata.MD{}); err != nil {
		return nil, err
	}
	env := &tunnelpb.Envelope{}
	if err := st.RecvMsg(env); err != nil {
		return nil, err
	}
	adv := env.Frame.GetAdvertise()
	if adv == nil {
		return nil, status.Error(codes.InvalidArgument, "first frame is not Advertise")
	}
	return adv, nil
}

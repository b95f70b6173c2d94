package integration

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The stall tests run Caddy with a 500ms tunnel_stall_timeout and a raw gRPC
// "agent" that advertises stall.test. Several clients POST large bodies to
// stall.test, so the node has far more to send than the agent's credit and
// the HTTP/2 buffering between the two ends can hold.
const (
	stallTimeout = 500 * time.Millisecond
	// stallPosts concurrent uploads: each is one virtual connection with
	// 64 KiB of credit (the advertised initial_window). One alone cannot
	// stall the node's sender: its credit runs out before gRPC flow control
	// (64 KiB stream window + 64 KiB write quota) blocks the sender.
	stallPosts    = 8
	stallBodySize = 64 << 20
	stallSluice   = "\t\ttunnel_stall_timeout 500ms\n\t\tdrain_grace 1s"
	stallSite     = `http://stall.test:{HTTP} {
	sluice
}`
)

// stallAgent is a Connect stream opened by hand, advertising stall.test.
type stallAgent struct {
	st     grpc.BidiStreamingClient[tunnelpb.Frame, tunnelpb.Frame]
	ctx    context.Context
	cancel context.CancelFunc
}

// stallDial dials c's control plane like an agent, with HTTP/2 windows fixed
// at 64 KiB: gRPC's BDP estimator would otherwise grow the stream window of
// a stream nobody reads, and how far it grows decides how much the node can
// push before it blocks.
func stallDial(t testing.TB, c *caddyServer) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(fmt.Sprintf("127.0.0.1:%d", c.controlPort),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})),
		grpc.WithStaticStreamWindowSize(64<<10),
		grpc.WithStaticConnWindowSize(64<<10))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	return cc
}

// stallConnect opens a Connect stream for agent id, advertises stall.test
// with initial_window 65536 and reads the AdvertiseAck (bounded).
func stallConnect(t testing.TB, cc *grpc.ClientConn, id string) *stallAgent {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+testToken, "x-sluice-id", id)
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		t.Fatalf("open Connect: %v", err)
	}
	a := &stallAgent{st: st, ctx: st.Context(), cancel: cancel}
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: id,
		Build:   "raw-stall-test",
		Routes: []*tunnelpb.Route{{
			Name: "stall", Host: "stall.test", Target: "http://127.0.0.1:9",
		}},
		InitialWindow: tunnelcore.InitialWindow,
	}}}); err != nil {
		t.Fatalf("send Advertise: %v", err)
	}
	f, err := a.recv(5 * time.Second)
	if err != nil {
		t.Fatalf("waiting for the AdvertiseAck: %v", err)
	}
	ack := f.GetAdvertiseAck()
	if ack == nil || len(ack.GetAccepted()) != 1 || ack.GetAccepted()[0].GetName() != "stall" {
		t.Fatalf("first frame from the node: %v, want an AdvertiseAck accepting route stall", f)
	}
	return a
}

var errRecvTimeout = errors.New("no frame in time")

// recv receives one frame, waiting at most d; on timeout the stream is
// cancelled (which ends the pending Recv).
func (a *stallAgent) recv(d time.Duration) (*tunnelpb.Frame, error) {
	type result struct {
		f   *tunnelpb.Frame
		err error
	}
	ch := make(chan result, 1)
	go func() {
		f, err := a.st.Recv()
		ch <- result{f, err}
	}()
	timer := time.NewTimer(d)
	defer timer.Stop()
	select {
	case r := <-ch:
		return r.f, r.err
	case <-timer.C:
		a.cancel()
		return nil, errRecvTimeout
	}
}

// stallSessions returns the node's registered sessions.
func stallSessions(t testing.TB, c *caddyServer) int {
	t.Helper()
	return c.mustStats(t).Sessions
}

// stallUploads starts n POSTs of stallBodySize bytes to stall.test, the
// i-th after i*stagger, all bounded by ctx; each result arrives on the
// returned channel.
func stallUploads(ctx context.Context, c *caddyServer, n int, stagger time.Duration) chan limResult {
	tr := &http.Transport{DisableCompression: true, MaxIdleConnsPerHost: n}
	cl := &http.Client{Transport: tr}
	out := make(chan limResult, n)
	for i := range n {
		go func() {
			select {
			case <-time.After(time.Duration(i) * stagger):
			case <-ctx.Done():
				out <- limResult{err: ctx.Err()}
				return
			}
			req := limRequest(ctx, c, "POST", "stall.test", "/upload", io.LimitReader(limZeroReader{}, stallBodySize))
			req.ContentLength = stallBodySize
			resp, err := cl.Do(req)
			if err != nil {
				out <- limResult{err: err}
				return
			}
			b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
			resp.Body.Close()
			out <- limResult{code: resp.StatusCode, body: string(b)}
		}()
	}
	go func() {
		<-ctx.Done()
		tr.CloseIdleConnections()
	}()
	return out
}

// TestStallWatchdogFailsNonReadingAgent: an agent that stops reading its
// Connect stream, while its gRPC connection stays up, is cut by the stall
// watchdog once the node's sender has been blocked for tunnel_stall_timeout,
// and the uploads it held fail promptly instead of hanging. Silence alone
// (nothing waiting to be sent) is not a stall.
func TestStallWatchdogFailsNonReadingAgent(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{Sluice: stallSluice}, stallSite)
	ag := stallConnect(t, stallDial(t, c), "stall-agent")
	if n := stallSessions(t, c); n != 1 {
		t.Fatalf("%d sessions after the AdvertiseAck, want 1", n)
	}
	// From here on the agent reads nothing.

	// An idle session with nothing to send is not stalled.
	time.Sleep(2 * stallTimeout)
	if n := stallSessions(t, c); n != 1 || ag.ctx.Err() != nil {
		t.Fatalf("idle session cut: %d sessions, stream ctx %v", n, ag.ctx.Err())
	}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	start := time.Now()
	results := stallUploads(ctx, c, stallPosts, 0)

	// The node's sender blocks once the gRPC buffering is full; the
	// watchdog fails the session stallTimeout later (checked every
	// stallTimeout/4).
	const bound = stallTimeout + 3*time.Second
	var peakQueued int64
	for stallSessions(t, c) != 0 {
		if time.Since(start) > bound {
			t.Fatalf("session still registered %v after the uploads began (stall_timeout %v); stats %+v",
				time.Since(start), stallTimeout, c.mustStats(t))
		}
		if st, ok := c.stats(); ok {
			peakQueued = max(peakQueued, st.Queued)
		}
		time.Sleep(5 * time.Millisecond)
	}
	took := time.Since(start)
	t.Logf("session failed %v after the uploads began (peak queued towards the agent: %d bytes)", took, peakQueued)
	if took < stallTimeout {
		t.Fatalf("session ended %v after the uploads began, before the stall timeout %v could pass", took, stallTimeout)
	}

	// Every upload ends promptly: an error status, or the connection closed.
	timer := time.NewTimer(5 * time.Second)
	defer timer.Stop()
	codes := map[string]int{}
	for i := range stallPosts {
		select {
		case r := <-results:
			switch {
			case r.err != nil:
				codes["error"]++
			case r.code == http.StatusBadGateway || r.code == http.StatusServiceUnavailable:
				codes[fmt.Sprint(r.code)]++
			default:
				t.Fatalf("upload %d: status %d, body %q; want 502/503 or a closed connection", i, r.code, r.body)
			}
		case <-timer.C:
			t.Fatalf("only %d of %d uploads ended within 5s of the session's end", i, stallPosts)
		}
	}
	t.Logf("uploads ended: %v", codes)

	// The node ended the stream: reading it now drains what was in flight
	// and then reaches its end.
	drained := 0
	for {
		_, err := ag.recv(5 * time.Second)
		if errors.Is(err, errRecvTimeout) {
			t.Fatalf("the stream did not end: no frame within 5s after %d frames", drained)
		}
		if err != nil {
			t.Logf("stream ended after %d more frames: %s", drained, limStatus(err))
			break
		}
		drained++
	}
}

// TestStallWatchdogSparesSlowReader: an agent that reads slowly (a frame
// every 20ms) under the same load and stall timeout keeps its session while
// it holds the node's sender back.
//
// A blocked Send waits for the peer to take bytes (up to about one frame
// plus gRPC's 16 KiB window-update step here), however many frames that
// is, so a reader paced in frames is only safe while the frames are not
// small: the reader grants credit back
// in half-window steps, as sluice's receiver does (granting each frame's
// bytes at once makes the node send small frames), and the uploads start
// 100ms apart (eight connections opening at once put some forty small
// frames, Connects, WindowUpdate{blocked}s and request heads, in front of
// it). Without either, the watchdog cuts this reader in some runs.
func TestStallWatchdogSparesSlowReader(t *testing.T) {
	// A stall timeout of 1 s against a reader taking a frame every 20 ms:
	// 50 times its pace, so a scheduling hiccup on a loaded machine is no
	// stall, and still well inside the run's 2 s and more.
	c := startCaddyWith(t, caddyOptions{Sluice: "\t\ttunnel_stall_timeout 1s\n\t\tdrain_grace 1s"}, stallSite)
	ag := stallConnect(t, stallDial(t, c), "slow-agent")

	var dataFrames, dataBytes atomic.Int64
	readErr := make(chan error, 1)
	go func() {
		unacked := map[uint64]int{} // DATA bytes read and not yet granted back, by connection
		for {
			f, err := ag.st.Recv()
			if err != nil {
				readErr <- err
				return
			}
			if d := f.GetData(); d != nil && len(d.GetPayload()) > 0 {
				dataFrames.Add(1)
				dataBytes.Add(int64(len(d.GetPayload())))
				unacked[d.GetConnId()] += len(d.GetPayload())
				if inc := unacked[d.GetConnId()]; inc >= tunnelcore.InitialWindow/2 {
					unacked[d.GetConnId()] = 0
					if err := ag.st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_WindowUpdate{WindowUpdate: &tunnelpb.WindowUpdate{
						ConnId: d.GetConnId(), Increment: uint32(inc),
					}}}); err != nil {
						readErr <- err
						return
					}
				}
			}
			select {
			case <-time.After(20 * time.Millisecond):
			case <-ag.ctx.Done():
				readErr <- ag.ctx.Err()
				return
			}
		}
	}()

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const stagger = 100 * time.Millisecond
	results := stallUploads(ctx, c, stallPosts, stagger)

	run := (stallPosts-1)*stagger + 2*time.Second
	start := time.Now()
	var peakQueued int64
	for time.Since(start) < run {
		st := c.mustStats(t)
		if st.Sessions != 1 {
			t.Fatalf("slow reader's session cut after %v (%d DATA frames read); stats %+v", time.Since(start), dataFrames.Load(), st)
		}
		peakQueued = max(peakQueued, st.Queued)
		select {
		case err := <-readErr:
			t.Fatalf("slow reader's stream ended after %v: %v", time.Since(start), err)
		case r := <-results:
			t.Fatalf("an upload ended while the slow reader reads: status %d, err %v", r.code, r.err)
		case <-time.After(10 * time.Millisecond):
		}
	}
	st := c.mustStats(t)
	t.Logf("after %v: %d DATA frames (%d bytes) read, peak queued towards the agent %d bytes; stats %+v",
		run, dataFrames.Load(), dataBytes.Load(), peakQueued, st)
	if st.Sessions != 1 || ag.ctx.Err() != nil {
		t.Fatalf("slow reader's session gone: %d sessions, stream ctx %v", st.Sessions, ag.ctx.Err())
	}
	if n := dataFrames.Load(); n < int64(run/(100*time.Millisecond)) {
		t.Fatalf("the slow reader read only %d DATA frames in %v", n, run)
	}
	// The reader held the node back: DATA waited in front of its sender.
	if peakQueued < 64<<10 {
		t.Fatalf("at most %d bytes ever waited in front of the node's sender: the reader did not hold it back", peakQueued)
	}
}

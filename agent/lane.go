package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"os"
	"time"

	"go.uber.org/zap"
	"golang.org/x/net/http/httpproxy"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/peer"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The data lane (proto/README §2.4): the node offers a ticket in the Connect
// stream's response header; the agent opens a second connection to the
// same address, presents the ticket, and runs the session's frames on it.
// The gRPC stream stays open beside it: it carries the session's end status
// and gRPC's keepalive, and its end ends the session. Whatever keeps the
// lane from opening leaves the session on the gRPC stream.

// Opening a lane must leave the Advertise time to reach the node on the
// gRPC stream when it fails: the node's advertise_timeout (10 s by
// default) runs from before it sends the header. laneHeaderWait bounds the
// wait for the header (a node sends it once it authorised the stream),
// laneDialTimeout the dial, the TLS handshake and the node's answer.
// After a lane failed, the link's next sessions to the same node stay
// on the gRPC stream for laneRetryAfter, so a path that never takes a
// lane (a load balancer that passes only gRPC, or one that sends the lane
// to another node) costs one attempt and one warning per period, not one
// per reconnect.
const (
	laneHeaderWait  = 3 * time.Second
	laneDialTimeout = 3 * time.Second
	laneRetryAfter  = 10 * time.Minute
)

// errFrameBesideLane: the node sent a frame on the gRPC stream while the
// session runs on the data lane.
var errFrameBesideLane = errors.New("node sent a frame on the gRPC stream while the session runs on the data lane")

// sessionTransport is what a session runs on.
type sessionTransport struct {
	frames   tunnelcore.FrameStream
	progress func() uint64 // the stall watchdog's progress reader
	onLane   bool          // frames is a data lane
	// directDial opens a connection's direct socket (proto/README §2.5);
	// nil when the node offered none or the session is not on a lane.
	directDial func(ctx context.Context, id uint64) (net.Conn, error)
}

// sessionFrames returns what the session runs on. rs is the Connect
// stream; cancel ends it; creds are the attempt's (attemptCredentials),
// which the lane and the direct sockets use as the stream's connection
// does, so that they present the same client certificate.
func (l *link) sessionFrames(ctx context.Context, creds credentials.TransportCredentials, rs *recordingStream, cancel func(), hostport string) sessionTransport {
	onGRPC := sessionTransport{frames: tunnelcore.GRPCStream(rs, cancel), progress: streamProgress(rs)}
	if l.a.cfg.DisableDataLane || behindProxy(hostport) || time.Now().UnixNano() < l.laneRetryAt.Load() {
		return onGRPC
	}
	offer := l.laneOffer(rs)
	if offer.ticket == "" {
		return onGRPC
	}
	addr := laneAddr(rs, hostport)
	conn, err := dialLane(ctx, creds, laneDialTimeout, addr, hostport, tunnelpb.LaneHello(offer.ticket))
	if err != nil {
		if ctx.Err() == nil {
			l.laneRetryAt.Store(time.Now().Add(laneRetryAfter).UnixNano())
			l.log().Warn("data lane unavailable; sessions run on the gRPC stream (disable_data_lane spares the attempt)",
				zap.String("server", l.target.Load().url), zap.Duration("retry_after", laneRetryAfter), zap.Error(err))
		}
		return onGRPC
	}
	t := sessionTransport{
		frames:   &agentLane{LaneStream: tunnelcore.ConnStream(conn), endGRPC: cancel},
		progress: tunnelcore.ConnProgress(conn),
		onLane:   true,
	}
	if offer.directKey != "" && !l.a.cfg.DisableDirectSockets {
		// Bounded by tunnelcore's context (directDialTimeout, 10 s): the
		// node may answer late and still have taken the socket.
		t.directDial = func(ctx context.Context, id uint64) (net.Conn, error) {
			return dialLane(ctx, creds, 0, addr, hostport, tunnelpb.DirectHello(offer.directKey, id))
		}
	}
	return t
}

// agentLane is the agent's session stream on a lane. When the node ended
// the lane, the gRPC stream is left open for the node's status, which tells
// why (the session's end reason reads it; the session's end ends the
// stream soon after); when the agent ends the session itself, it ends the
// gRPC stream at once, as it does without a lane.
type agentLane struct {
	tunnelcore.LaneStream
	endGRPC func()
}

func (l *agentLane) Close(cause error) {
	l.LaneStream.Close(cause)
	if !l.PeerEnded() {
		l.endGRPC()
	}
}

// laneOffer is what a node's response header offers: a lane ticket, and
// the session's key for direct sockets.
type laneOffer struct{ ticket, directKey string }

// laneOffer waits for the Connect stream's response header (a node sends
// it as soon as it authorised the stream) and returns what it offers: no
// ticket when none was offered or the stream failed (the session reports
// why). The wait is bounded by laneHeaderWait.
func (l *link) laneOffer(st grpc.ClientStream) laneOffer {
	ch := make(chan laneOffer, 1)
	go func() {
		md, err := st.Header()
		if err != nil {
			ch <- laneOffer{}
			return
		}
		var o laneOffer
		if v := md.Get(tunnelpb.LaneHeader); len(v) == 1 && len(v[0]) == tunnelpb.LaneTicketLength {
			o.ticket = v[0]
		}
		if v := md.Get(tunnelpb.DirectHeader); len(v) == 1 && len(v[0]) == tunnelpb.DirectKeyLength {
			o.directKey = v[0]
		}
		ch <- o
	}()
	t := time.NewTimer(min(l.a.ackTimeout, laneHeaderWait))
	defer t.Stop()
	select {
	case o := <-ch:
		return o
	case <-t.C:
		// A node that sends no header before the Advertise offers no
		// lane: spare the wait for a while (laneRetryAfter).
		l.laneRetryAt.Store(time.Now().Add(laneRetryAfter).UnixNano())
		return laneOffer{}
	}
}

// laneAddr is the address to open the lane to: the one the Connect stream
// is connected to. Resolving hostport again could pick another of its
// addresses (DNS round robin over several nodes), whose node never issued
// the ticket. hostport itself where the stream's peer is not known.
func laneAddr(st grpc.ClientStream, hostport string) string {
	if p, ok := peer.FromContext(st.Context()); ok {
		if ta, ok := p.Addr.(*net.TCPAddr); ok {
			return ta.String()
		}
	}
	return hostport
}

// dialLane opens a lane, or a direct socket, to addr with the session
// attempt's transport credentials (verifying the node as hostport, as the
// gRPC connection does) and presents hello, within timeout (0: ctx's).
func dialLane(ctx context.Context, creds credentials.TransportCredentials, timeout time.Duration, addr, hostport string, hello []byte) (net.Conn, error) {
	if timeout > 0 {
		var cancel context.CancelFunc
		ctx, cancel = context.WithTimeout(ctx, timeout)
		defer cancel()
	}
	// TCP keepalive stands in for the stream's HTTP/2 pings: it keeps an
	// idle lane's NAT mapping and finds a dead lane in about a minute.
	d := net.Dialer{KeepAliveConfig: net.KeepAliveConfig{Enable: true, Idle: 15 * time.Second, Interval: 15 * time.Second, Count: 4}}
	raw, err := d.DialContext(ctx, "tcp", addr)
	if err != nil {
		return nil, err
	}
	conn, _, err := creds.ClientHandshake(ctx, hostport, raw)
	if err != nil {
		raw.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	if err := presentHello(ctx, conn, hello); err != nil {
		conn.Close()
		return nil, err
	}
	return tunnelcore.OverSocket(conn, raw), nil
}

// presentHello writes a lane's or direct socket's preface and reads the
// node's answer.
func presentHello(ctx context.Context, conn net.Conn, hello []byte) error {
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()
	if _, err := conn.Write(hello); err != nil {
		return fmt.Errorf("sending the preface: %w", err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(conn, answer[:]); err != nil {
		if ctx.Err() != nil || errors.Is(err, os.ErrDeadlineExceeded) {
			// Sent, and no answer in time: the node may have taken it
			// meanwhile. (A node that does not take it closes it.)
			return fmt.Errorf("the node did not answer: %w: %w", tunnelcore.ErrPrefaceUnanswered, err)
		}
		return fmt.Errorf("the node did not take the connection: %w", err)
	}
	switch answer[0] {
	case tunnelpb.LaneAccepted:
	case tunnelpb.DirectNotOpen:
		return fmt.Errorf("the node has that connection no longer: %w", tunnelcore.ErrNotDirect)
	default:
		return fmt.Errorf("the node did not take the connection (answered %#x)", answer[0])
	}
	if !stop() {
		// Answered, as the time ran out: the node took it.
		return fmt.Errorf("%w: %w", tunnelcore.ErrPrefaceUnanswered, ctx.Err())
	}
	return nil
}

// behindProxy reports whether gRPC reaches hostport through an HTTP proxy
// (HTTPS_PROXY, NO_PROXY), which a lane cannot take.
func behindProxy(hostport string) bool {
	u, err := httpproxy.FromEnvironment().ProxyFunc()(&url.URL{Scheme: "https", Host: hostport})
	return err == nil && u != nil
}

// watchGRPCBesideLane ends a session on a data lane when the gRPC stream
// beside it ends (the node's status is kept by rs for the session's end
// reason) or carries a frame it must not.
func watchGRPCBesideLane(sess *tunnelcore.Session, rs *recordingStream) {
	env := &tunnelpb.Envelope{}
	if err := rs.RecvMsg(env); err != nil {
		sess.CloseWithError(err)
		return
	}
	env.Payload.Free()
	sess.CloseWithError(errFrameBesideLane)
	// Read on until the stream ends (closing the session cancels it): the
	// session's end reason waits up to recvErrWait for the stream's status
	// (rs.recvDone), which held the reconnect back 2 s.
	for {
		env = &tunnelpb.Envelope{}
		if rs.RecvMsg(env) != nil {
			return
		}
		env.Payload.Free()
	}
}

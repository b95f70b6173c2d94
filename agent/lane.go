package agent

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"net/url"
	"time"

	"go.uber.org/zap"
	"golang.org/x/net/http/httpproxy"
	"google.golang.org/grpc"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The data lane (proto/README §2.4): the node offers a ticket in the Connect
// stream's response header; the agent opens a second connection to the
// same address, presents the ticket, and runs the session's frames on it.
// The gRPC stream stays open beside it: it carries the session's end status
// and gRPC's keepalive, and its end ends the session. Whatever keeps the
// lane from opening leaves the session on the gRPC stream.

// laneDialTimeout bounds opening a lane: the dial, the TLS handshake and
// the node's answer.
const laneDialTimeout = 10 * time.Second

// errFrameBesideLane: the node sent a frame on the gRPC stream while the
// session runs on the data lane.
var errFrameBesideLane = errors.New("node sent a frame on the gRPC stream while the session runs on the data lane")

// sessionFrames returns what the session runs on, its stall watchdog's
// progress reader, and whether it is a data lane. rs is the Connect
// stream; cancel ends it.
func (a *Agent) sessionFrames(ctx context.Context, rs *recordingStream, cancel func(), hostport string) (tunnelcore.FrameStream, func() uint64, bool) {
	grpcFrames, progress := tunnelcore.GRPCStream(rs, cancel), streamProgress(rs)
	if a.cfg.DisableDataLane || behindProxy(hostport) {
		return grpcFrames, progress, false
	}
	ticket := a.laneTicket(rs)
	if ticket == "" {
		return grpcFrames, progress, false
	}
	conn, err := a.dialLane(ctx, hostport, ticket)
	if err != nil {
		if ctx.Err() == nil {
			a.log.Warn("data lane unavailable; the session runs on the gRPC stream (disable_data_lane spares the attempt)",
				zap.String("server", a.cfg.Server), zap.Error(err))
		}
		return grpcFrames, progress, false
	}
	return tunnelcore.ConnStream(conn), tunnelcore.ConnProgress(conn), true
}

// laneTicket waits for the Connect stream's response header (a node sends
// it as soon as it authorised the stream) and returns the lane ticket it
// offers, or "" (none offered, or the stream failed: the session reports
// why). The wait is bounded by the AdvertiseAck timeout.
func (a *Agent) laneTicket(st grpc.ClientStream) string {
	type header struct{ ticket string }
	ch := make(chan header, 1)
	go func() {
		md, err := st.Header()
		if err != nil {
			ch <- header{}
			return
		}
		var h header
		if v := md.Get(tunnelpb.LaneHeader); len(v) == 1 && len(v[0]) == tunnelpb.LaneTicketLength {
			h.ticket = v[0]
		}
		ch <- h
	}()
	t := time.NewTimer(a.ackTimeout)
	defer t.Stop()
	select {
	case h := <-ch:
		return h.ticket
	case <-t.C:
		return ""
	}
}

// dialLane opens a lane to hostport with the agent's transport credentials
// and presents ticket.
func (a *Agent) dialLane(ctx context.Context, hostport, ticket string) (net.Conn, error) {
	ctx, cancel := context.WithTimeout(ctx, laneDialTimeout)
	defer cancel()
	var d net.Dialer
	raw, err := d.DialContext(ctx, "tcp", hostport)
	if err != nil {
		return nil, err
	}
	conn, _, err := a.creds.ClientHandshake(ctx, hostport, raw)
	if err != nil {
		raw.Close()
		return nil, fmt.Errorf("handshake: %w", err)
	}
	if err := presentTicket(ctx, conn, ticket); err != nil {
		conn.Close()
		return nil, err
	}
	return conn, nil
}

// presentTicket writes the lane preface and reads the node's answer.
func presentTicket(ctx context.Context, conn net.Conn, ticket string) error {
	stop := context.AfterFunc(ctx, func() { conn.SetDeadline(time.Now()) })
	defer stop()
	if _, err := conn.Write(tunnelpb.LaneHello(ticket)); err != nil {
		return fmt.Errorf("sending the ticket: %w", err)
	}
	var answer [1]byte
	if _, err := io.ReadFull(conn, answer[:]); err != nil {
		return fmt.Errorf("the node did not take the lane: %w", err)
	}
	if answer[0] != tunnelpb.LaneAccepted {
		return fmt.Errorf("the node did not take the lane (answered %#x)", answer[0])
	}
	if !stop() {
		return ctx.Err()
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
	err := rs.RecvMsg(env)
	if err == nil {
		env.Payload.Free()
		err = errFrameBesideLane
	}
	sess.CloseWithError(err)
}

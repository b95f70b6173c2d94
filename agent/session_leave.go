package agent

import (
	"context"
	"errors"
	"math"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// errLeft ends a session the agent left (Leave).
var errLeft = errors.New("agent shutting down")

// leaving is the state of a session the agent is leaving: it sent Drain
// and serves on until the node ends the session, which it does once no
// connection is open nor being opened (only the node knows of the opens
// it has under way), or until the grace is over.
type leaving struct {
	l         *link
	sess      *tunnelcore.Session
	withdrawn bool // the node answered: nothing new will be routed here
}

// startLeaving sends the node Drain, with the grace the link's leave
// context leaves (Leave's, or the shutdown grace for a link leaving alone).
func (l *link) startLeaving(sess *tunnelcore.Session) *leaving {
	var grace time.Duration
	graceText := "none (until told to stop)"
	if dl, ok := l.leaveCtx.Deadline(); ok {
		grace = max(time.Until(dl), time.Millisecond)
		graceText = grace.Round(time.Millisecond).String()
	}
	l.setState(StateLeaving)
	l.log().Info("leaving the node: no new connections; waiting for the open ones to finish",
		zap.String("reason", l.leaveWhy), zap.Int("connections", sess.NumConns()), zap.String("grace", graceText))
	_ = sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Drain{Drain: &tunnelpb.Drain{
		GraceMs: uint32(min(grace, time.Duration(math.MaxUint32)*time.Millisecond) / time.Millisecond),
		Reason:  l.leaveWhy,
	}}})
	return &leaving{l: l, sess: sess}
}

// answered takes an AdvertiseAck that came while leaving. The node answers
// Drain with one that lists no route (every Advertise lists at least one,
// so an ack answering one sent before Drain cannot be mistaken for it).
func (l *leaving) answered(ack *tunnelpb.AdvertiseAck) {
	if l.withdrawn || len(ack.GetAccepted())+len(ack.GetRejected()) > 0 {
		return
	}
	l.withdrawn = true
	l.l.log().Debug("node withdrew the routes", zap.Int("connections", l.sess.NumConns()))
}

// ended logs the end of the session. The node ends it without an error
// status once no connection is left, having answered the Drain, and
// without draining itself (a node shutting down ends sessions that way too).
func (l *leaving) ended(err error, nodeDrained bool) {
	code, msg := statusOf(err)
	clean := code == codes.OK || code == codes.Unknown
	log := l.l.log()
	switch {
	case clean && l.withdrawn && !nodeDrained:
		log.Info("left the node: every connection finished")
	case clean: // the node ended it otherwise (it shut down, say)
		log.Info("session ended while leaving", zap.String("reason", msg))
	default:
		log.Warn("session ended while leaving", zap.String("reason", msg), zap.String("code", code.String()))
	}
}

// cut ends the session when the grace is over, or on a second signal.
func (l *leaving) cut(sess *tunnelcore.Session) {
	why := "shutdown grace over"
	if !errors.Is(l.l.leaveCtx.Err(), context.DeadlineExceeded) {
		why = "told to stop now"
	}
	l.l.log().Warn(why+"; cutting the connections still open", zap.Int("connections", sess.NumConns()))
	sess.CloseWithError(errLeft)
}

package caddymodule

import (
	"context"
	"errors"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// leave serves an agent's Drain: the agent is shutting down. Its routes are
// withdrawn from every lookup and its ports released, so new requests and
// connections go to other agents, while the connections it has open run on.
// The answer is an AdvertiseAck with no routes. The session's idle pooled
// HTTP connections are closed (closeIdleHTTP), and the node ends the
// session once no connection is left, or the grace ran out (endWhenIdle).
func (n *node) leave(a *agentSession, d *tunnelpb.Drain) {
	n.admitMu.Lock()
	withdrawn := n.reg.withdraw(a)
	if withdrawn {
		n.releasePorts(a.currentRoutes(&n.reg.mu))
	}
	n.sendAck(a, nil)
	if withdrawn {
		n.noticeOverlapsLocked(a, a.currentRoutes(&n.reg.mu))
	}
	n.admitMu.Unlock()
	if !withdrawn {
		return
	}
	grace := time.Duration(d.GetGraceMs()) * time.Millisecond
	if grace <= 0 || grace > maxLeaveGrace {
		grace = maxLeaveGrace
	}
	if ok, suppressed := n.sessionLog.Allow(); ok {
		n.log().Info("agent leaving; its routes take no new connections", zap.String("agent", a.agentID),
			zap.String("reason", truncate(d.GetReason(), maxLoggedMessage)), zap.Int("open_connections", a.sess.NumConns()),
			zap.Duration("grace", grace), zap.Int("suppressed_since_last", suppressed))
	}
	// Off the session's receive loop: closing a connection sends frames.
	go a.closeIdleHTTP()
	go n.endWhenIdle(a, grace)
}

// closeIdleHTTP closes the pooled HTTP connections of a leaving session
// when none of its requests is in flight: they are all idle then, nothing
// will pick them again, and open they would hold the session until the
// transport's idle timeout. Upgraded connections and TCP relays are left
// to finish. While a RoundTrip is under way (it holds sweepMu for
// reading) it does nothing: that request's end sweeps (requestDone).
func (a *agentSession) closeIdleHTTP() {
	if a.requests.Load() != 0 || !a.sweepMu.TryLock() {
		return
	}
	defer a.sweepMu.Unlock()
	if a.requests.Load() != 0 {
		return
	}
	for _, c := range a.sess.Conns() {
		if h, ok := c.Info().Tag.(*httpConn); ok && !h.upgraded.Load() {
			_ = c.Close()
		}
	}
}

// errAgentLeft ends the session of an agent that left (Drain), and fails
// an open on it once it is being ended: a retryable 503 for HTTP.
// errLeaveGraceOver ends one whose connections outlived its grace.
var (
	errAgentLeft      = errors.New("the agent left (shutting down)")
	errLeaveGraceOver = errors.New("the leaving agent's connections outlived its grace")
)

const (
	// leavePoll is how often the node checks whether a leaving session
	// has no connection left.
	leavePoll = 25 * time.Millisecond
	// leaveSweep is how often it closes the session's idle pooled HTTP
	// connections again: net/http may pool one with no request to tell
	// (a connection dialed for a request that took another).
	leaveSweep = time.Second
	// leaveMargin is how long past the grace its agent announced the node
	// waits before it ends a leaving session itself.
	leaveMargin = 5 * time.Second
	// maxLeaveGrace caps that grace (0, from the agent, is none): a
	// leaving session must end, as its id's successor is admitted past
	// max_sessions.
	maxLeaveGrace = tunnelpb.MaxLeaveGrace
)

// endWhenIdle ends a leaving session once it has no connection open nor
// being opened. The node decides, not the agent: only the node knows of the
// opens it has under way (a request that chose the agent just before its
// routes were withdrawn). An agent that outlives its announced grace (at
// most maxLeaveGrace) by leaveMargin is ended too.
func (n *node) endWhenIdle(a *agentSession, grace time.Duration) {
	over := time.NewTimer(grace + leaveMargin)
	defer over.Stop()
	tick := time.NewTicker(leavePoll)
	defer tick.Stop()
	lastSweep := time.Now()
	for !a.endIfIdle() {
		if time.Since(lastSweep) >= leaveSweep {
			a.closeIdleHTTP()
			lastSweep = time.Now()
		}
		select {
		case <-a.sess.Done():
			return
		case <-over.C:
			n.log().Warn("leaving agent still has connections past its grace; ending its session",
				zap.String("agent", a.agentID), zap.Int("open_connections", a.sess.NumConns()), zap.Duration("grace", grace))
			a.endMu.Lock()
			a.ended = true
			a.endMu.Unlock()
			a.sess.CloseWithError(errLeaveGraceOver)
			return
		case <-tick.C:
		}
	}
	// The answer to its Drain first (closing drops what is queued): the
	// agent reads it as its routes withdrawn, and the end as a clean leave.
	ctx, cancel := context.WithTimeout(context.Background(), leaveMargin)
	a.sess.Flush(ctx)
	cancel()
	a.sess.CloseWithError(errAgentLeft)
}

// endIfIdle marks a session ended if no connection is open on it or being
// opened, and reports whether it did.
func (a *agentSession) endIfIdle() bool {
	a.endMu.Lock()
	defer a.endMu.Unlock()
	if a.opening.Load() == 0 && a.sess.NumConns() == 0 {
		a.ended = true
	}
	return a.ended
}

// startOpen counts an open on a, unless a is being ended; the caller
// decrements opening when its open returned (the connection, if any, is
// then counted by the session).
func (a *agentSession) startOpen() bool {
	a.endMu.Lock()
	defer a.endMu.Unlock()
	if a.ended {
		return false
	}
	a.opening.Add(1)
	return true
}

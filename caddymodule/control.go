package caddymodule

import (
	"fmt"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// onControl handles session frames after the handshake. A repeated
// Advertise replaces the agent's routes.
func (n *node) onControl(a *agentSession, f *tunnelpb.Frame) {
	switch k := f.GetKind().(type) {
	case *tunnelpb.Frame_Advertise:
		n.readvertise(a, k.Advertise.GetRoutes())
	case *tunnelpb.Frame_Drain:
		n.leave(a, k.Drain)
	case *tunnelpb.Frame_Error:
		if ok, suppressed := n.agentErrLog.Allow(); ok {
			n.log().Warn("agent reported an error", zap.String("agent", a.agentID),
				zap.String("message", truncate(k.Error.GetMessage(), maxLoggedMessage)), zap.Int("suppressed_since_last", suppressed))
		}
	default:
		n.log().Debug("ignoring frame from agent", zap.String("agent", a.agentID), zap.String("frame", fmt.Sprintf("%T", k)))
	}
}

// readvertiseEvery paces an agent's repeated Advertises (an agent retries
// its rejected routes with a backoff of a second and more): one admitted in
// less than this after the last waits for its turn, and a newer one takes
// its place. Each re-admission holds the node-wide admitMu and answers with
// an ack listing every route, so an agent sending Advertises without pause
// would otherwise keep every other agent's connect, leave and reload
// waiting, and pile acks up in its queue.
const readvertiseEvery = time.Second

// readvertise admits a repeated Advertise of a, at its turn.
func (n *node) readvertise(a *agentSession, routes []*tunnelpb.Route) {
	rv := &a.readv
	rv.mu.Lock()
	defer rv.mu.Unlock()
	if wait := readvertiseEvery - time.Since(rv.last); wait > 0 {
		rv.pending = routes
		if !rv.waiting {
			rv.waiting = true
			time.AfterFunc(wait, func() { n.readvertiseDue(a) })
		}
		return
	}
	n.readvertiseLocked(a, routes)
}

// readvertiseDue admits the Advertise that waited for its turn.
func (n *node) readvertiseDue(a *agentSession) {
	rv := &a.readv
	rv.mu.Lock()
	defer rv.mu.Unlock()
	routes := rv.pending
	rv.pending, rv.waiting = nil, false
	n.readvertiseLocked(a, routes)
}

// readvertiseLocked admits routes now. Callers hold a.readv.mu.
func (n *node) readvertiseLocked(a *agentSession, routes []*tunnelpb.Route) {
	a.readv.last = time.Now()
	n.admitMu.Lock()
	n.readmitLocked(a, routes)
	n.admitMu.Unlock()
}

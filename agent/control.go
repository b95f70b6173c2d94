package agent

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// control takes the node's control messages, one handler per message (as
// frp's client control registers one handler per message type). The
// handlers run on the session's receive loop, which must never block: they
// log, or record what came and signal the session's serve loop, which acts
// on it (sessionAttempt.loop).
type control struct {
	logger func() *zap.Logger
	acks   *latestAck
	// drains receives the grace of the node's Drain, once per session
	// (drained guards it).
	drains  chan time.Duration
	drained atomic.Bool
	// spread is the reconnect spread the node's Drain asked for (0:
	// none), stored before drained is set.
	spread atomic.Int64
	// onMembership takes the node's MembershipUpdate, with the id of the
	// node that sent it; it must not block. nil: logged only.
	onMembership func(sender string, m *tunnelpb.MembershipUpdate)
	// nodeID is the id of the node's latest AdvertiseAck: the sender of
	// the MembershipUpdates after it. Only dispatch (the session's
	// receive loop) touches it.
	nodeID string
}

func newControl(log *zap.Logger) *control {
	return &control{logger: func() *zap.Logger { return log }, acks: newLatestAck(), drains: make(chan time.Duration, 1)}
}

// newLinkControl is the control of a session of link l dialed to t: it
// logs with the link's logger and offers the node's membership to the
// cluster.
func newLinkControl(l *link, t *linkTarget) *control {
	c := newControl(nil)
	c.logger = l.log
	c.onMembership = func(sender string, m *tunnelpb.MembershipUpdate) { l.a.cluster.offer(l, t, sender, m) }
	return c
}

// dispatch hands f to the handler of its message; it is the session's
// tunnelcore.Config.OnControl.
func (c *control) dispatch(f *tunnelpb.Frame) {
	switch k := f.Kind.(type) {
	case *tunnelpb.Frame_AdvertiseAck:
		c.onAdvertiseAck(k.AdvertiseAck)
	case *tunnelpb.Frame_Drain:
		c.onDrain(k.Drain)
	case *tunnelpb.Frame_MembershipUpdate:
		c.onMembershipUpdate(k.MembershipUpdate)
	case *tunnelpb.Frame_Error:
		c.onError(k.Error)
	default:
		c.logger().Debug("unexpected control frame ignored", zap.String("frame", fmt.Sprintf("%T", f.Kind)))
	}
}

// onAdvertiseAck keeps the newest ack for the serve loop: every ack states
// the whole route set, so a newer one supersedes one not yet taken.
func (c *control) onAdvertiseAck(ack *tunnelpb.AdvertiseAck) {
	c.nodeID = ack.GetNodeId()
	c.acks.put(ack)
}

// onDrain passes the grace of the node's first Drain to the serve loop,
// which ends the session itself if the node does not within it, and keeps
// its reconnect spread for the link's next attempt.
func (c *control) onDrain(d *tunnelpb.Drain) {
	// dispatch runs on the session's receive loop alone: no other onDrain
	// runs meanwhile. The spread is stored before drained, so whoever sees
	// drained sees it.
	if c.drained.Load() {
		return
	}
	spread := drainSpread(d)
	c.spread.Store(int64(spread))
	c.drained.Store(true)
	grace := time.Duration(d.GetGraceMs()) * time.Millisecond
	fields := []zap.Field{zap.String("reason", d.GetReason()), zap.String("grace", grace.String())}
	if spread > 0 {
		fields = append(fields, zap.String("reconnect_spread", spread.String()))
	}
	c.logger().Info("node draining", fields...)
	c.drains <- grace // buffered, and sent once: never blocks
}

// minDrainSpread is the least reconnect spread a Drain asks for; below it
// (or 0: a node that predates the field) the agent reconnects with its
// backoff alone.
const minDrainSpread = time.Second

// drainSpread is the reconnect spread d asks for; 0 for none.
func drainSpread(d *tunnelpb.Drain) time.Duration {
	spread := time.Duration(d.GetReconnectSpreadMs()) * time.Millisecond
	if spread < minDrainSpread {
		return 0
	}
	return spread
}

// onMembershipUpdate logs the node's cluster membership and hands it on,
// with the node's id, to the cluster, which decides what it changes.
func (c *control) onMembershipUpdate(m *tunnelpb.MembershipUpdate) {
	c.logger().Debug("membership update", zap.String("from_node", c.nodeID), zap.Strings("nodes", memberNames(m.GetNodes())))
	if c.onMembership != nil {
		c.onMembership(c.nodeID, m)
	}
}

// onError logs an error the node reports about the session; the node
// ends the session itself when the error is fatal.
func (c *control) onError(e *tunnelpb.Error) {
	c.logger().Warn("node reported an error", zap.String("code", e.GetCode().String()), zap.String("message", e.GetMessage()))
}

// nodeDrained reports whether the node sent Drain.
func (c *control) nodeDrained() bool { return c.drained.Load() }

// reconnectSpread is the reconnect spread of the node's Drain; 0 without
// a Drain, or one that asked for none.
func (c *control) reconnectSpread() time.Duration {
	if !c.drained.Load() {
		return 0
	}
	return time.Duration(c.spread.Load())
}

// latestAck holds the newest AdvertiseAck the session loop has not taken
// yet. Every ack states the session's whole route set (its accepted and
// rejected routes), so a newer one supersedes an older one: the session's
// receive loop, which must never block, replaces instead of queueing, and
// a burst of acks (a node re-admitting routes on each of many reloads)
// cannot make the agent lose the last one and act on a stale state.
type latestAck struct {
	mu  sync.Mutex
	ack *tunnelpb.AdvertiseAck
	// ready has a value while an ack waits to be taken.
	ready chan struct{}
}

func newLatestAck() *latestAck { return &latestAck{ready: make(chan struct{}, 1)} }

// put replaces the waiting ack, if any, with ack.
func (l *latestAck) put(ack *tunnelpb.AdvertiseAck) {
	l.mu.Lock()
	l.ack = ack
	l.mu.Unlock()
	select {
	case l.ready <- struct{}{}:
	default: // already signalled; the taker reads the newest
	}
}

// take returns the waiting ack, or nil when there is none (its signal was
// for an ack taken already).
func (l *latestAck) take() *tunnelpb.AdvertiseAck {
	l.mu.Lock()
	defer l.mu.Unlock()
	ack := l.ack
	l.ack = nil
	return ack
}

// routeState tracks which routes the node rejected, and which it reports
// also served by agents of other credentials, to log changes once.
type routeState struct {
	rejected map[string]string     // name -> reason
	overlaps map[routeOverlap]bool // -> shadowed
}

// routeOverlap is one route of the session that an agent of another
// credential serves too.
type routeOverlap struct {
	route, otherCredential, otherAgentID string
}

func newRouteState() *routeState {
	return &routeState{rejected: map[string]string{}, overlaps: map[routeOverlap]bool{}}
}

// update logs the rejections of ack that are new, the routes that are
// accepted after a rejection, and the overlaps that began or ended; it
// returns the accepted route names.
func (r *routeState) update(log *zap.Logger, ack *tunnelpb.AdvertiseAck) []string {
	accepted := make([]string, 0, len(ack.GetAccepted()))
	for _, k := range ack.GetAccepted() {
		accepted = append(accepted, k.GetName())
		if reason, was := r.rejected[k.GetName()]; was {
			log.Info("route accepted after retry", zap.String("route", k.GetName()), zap.String("previous_reason", reason))
			delete(r.rejected, k.GetName())
		}
	}
	for _, rj := range ack.GetRejected() {
		if prev, was := r.rejected[rj.GetName()]; was && prev == rj.GetReason() {
			log.Debug("route still rejected", zap.String("route", rj.GetName()), zap.String("reason", rj.GetReason()))
			continue
		}
		fields := []zap.Field{zap.String("route", rj.GetName()), zap.String("reason", rj.GetReason())}
		if rj.GetListenPort() != 0 {
			fields = append(fields, zap.Uint32("listen_port", rj.GetListenPort()))
		}
		if outOfScope(rj) {
			fields = append(fields, zap.String("hint", "outside the scope of the agent's credential: not retried; the node admits it again if its config changes"))
		}
		log.Warn("route rejected by node", fields...)
		r.rejected[rj.GetName()] = rj.GetReason()
	}
	r.updateOverlaps(log, ack.GetOverlaps())
	return accepted
}

// updateOverlaps logs each overlap of the ack that is new (or whose
// shadowed changed) at warn, each that ended at info, and nothing for the
// others: every ack states the whole list, and the node sends a fresh
// ack whenever it changes, so that logging all would repeat them.
func (r *routeState) updateOverlaps(log *zap.Logger, overlaps []*tunnelpb.RouteOverlap) {
	now := make(map[routeOverlap]bool, len(overlaps))
	for _, o := range overlaps {
		k := routeOverlap{route: o.GetName(), otherCredential: o.GetOtherCredential(), otherAgentID: o.GetOtherAgentId()}
		now[k] = o.GetShadowed()
		if shadowed, was := r.overlaps[k]; was && shadowed == o.GetShadowed() {
			continue
		}
		log.Warn("route also served by an agent of another credential", k.fields(o.GetShadowed())...)
	}
	ended := make([]routeOverlap, 0, len(r.overlaps))
	for k := range r.overlaps {
		if _, still := now[k]; !still {
			ended = append(ended, k)
		}
	}
	slices.SortFunc(ended, routeOverlap.compare) // logs in a stable order
	for _, k := range ended {
		log.Info("route no longer served by an agent of another credential", k.fields(r.overlaps[k])...)
	}
	r.overlaps = now
}

func (k routeOverlap) fields(shadowed bool) []zap.Field {
	return []zap.Field{zap.String("route", k.route), zap.String("other_credential", credentialName(k.otherCredential)),
		zap.String("other_agent_id", k.otherAgentID), zap.Bool("shadowed", shadowed)}
}

func (k routeOverlap) compare(o routeOverlap) int {
	return cmp.Or(cmp.Compare(k.route, o.route), cmp.Compare(k.otherCredential, o.otherCredential), cmp.Compare(k.otherAgentID, o.otherAgentID))
}

// credentialName is how logs and the status name a credential the node
// reports: "" is the node's unscoped token, shown as the node shows it.
func credentialName(name string) string {
	if name == "" {
		return unscopedCredential
	}
	return name
}

// unscopedCredential names the node's unscoped token in logs and status.
const unscopedCredential = "(token)"

// reasonOutOfScope starts the reason of a route the node rejects as
// outside the scope of the agent's credential.
const reasonOutOfScope = "out_of_scope"

// outOfScope reports whether the node rejected rj as outside the scope of
// the agent's credential.
func outOfScope(rj *tunnelpb.RejectedRoute) bool {
	return strings.HasPrefix(rj.GetReason(), reasonOutOfScope)
}

// retryable reports whether ack rejects a route that advertising it again
// may get in: a listen port held by another agent or in use may free up.
// A route outside the credential's scope stays out until the node's
// config changes, and the node admits it again by itself on that reload.
func retryable(ack *tunnelpb.AdvertiseAck) bool {
	return slices.ContainsFunc(ack.GetRejected(), func(rj *tunnelpb.RejectedRoute) bool { return !outOfScope(rj) })
}

// readvertiser schedules the Advertise again after a backoff while the
// node rejects routes (a listen port outside the node's range, held by an
// agent with a smaller id, or in use); an ack that rejects none, or only
// routes outside the credential's scope (retryable), resets it.
type readvertiser struct {
	log   *zap.Logger
	bo    *backoff
	timer *time.Timer // nil while none is scheduled
}

func newReadvertiser(a *Agent, log *zap.Logger) *readvertiser {
	return &readvertiser{log: log, bo: newBackoff(a.backoffInitial, a.backoffMax, nil)}
}

// onAck schedules the re-Advertise the node's ack calls for.
func (r *readvertiser) onAck(ack *tunnelpb.AdvertiseAck) { r.schedule(retryable(ack)) }

// schedule replaces the scheduled re-Advertise: a new one after the next
// backoff when routes were rejected, none (and the backoff reset) when not.
func (r *readvertiser) schedule(rejected bool) {
	r.stop()
	if !rejected {
		r.bo.Reset()
		return
	}
	d := r.bo.Next()
	r.log.Debug("re-advertising rejected routes later", zap.Duration("in", d))
	r.timer = time.NewTimer(d)
}

// C fires when the re-Advertise is due; nil (never) while none is scheduled.
func (r *readvertiser) C() <-chan time.Time {
	if r.timer == nil {
		return nil
	}
	return r.timer.C
}

// fired marks the scheduled re-Advertise as taken from C.
func (r *readvertiser) fired() { r.timer = nil }

// stop cancels the scheduled re-Advertise, if any.
func (r *readvertiser) stop() {
	if r.timer != nil {
		r.timer.Stop()
		r.timer = nil
	}
}

package agent

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"net"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"

	"github.com/sluice-tunnel/sluice/internal/ident"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Errors of a check's result (CheckResult.Err), which sluice-agent check
// turns into distinct exit codes.
var (
	// ErrCheckUnreachable: a node could not be reached, refused the
	// agent's credential, or did not answer its Advertise.
	ErrCheckUnreachable = errors.New("node not reached")
	// ErrCheckRejected: a node rejected at least one route.
	ErrCheckRejected = errors.New("route rejected")
)

// checkLeaveGrace bounds how long a check waits for the node to end its
// session after the Drain: the check's session serves no client of its
// own, so the node normally ends it at once.
const checkLeaveGrace = 5 * time.Second

// CheckResult is what Check found: one NodeCheck per node it dialed, in
// the order of the configuration (the server, or each of its addresses).
type CheckResult struct {
	// AgentID is the id the check advertised as (see Check).
	AgentID string
	Nodes   []NodeCheck
}

// NodeCheck is one node's answer to the agent's Advertise.
type NodeCheck struct {
	// Server is the URL the check dialed.
	Server string
	// NodeID, NodeBuild and Credential are from the node's AdvertiseAck:
	// its id, its build and the credential it authenticated the agent as
	// ("" for the node's unscoped token).
	NodeID, NodeBuild, Credential string
	// Accepted names the routes the node accepted.
	Accepted []string
	// Rejected are the routes the node rejected, with its reasons.
	Rejected []RejectedRoute
	// HeldByAgent are the listen-port routes the node refused only
	// because the agent of the configured id, running beside the check,
	// holds their port (tunnelpb.PortHeldReason): that agent has them,
	// so they are no rejection.
	HeldByAgent []RejectedRoute
	// Overlaps are the accepted routes an agent of another credential
	// serves too.
	Overlaps []RouteOverlap
	// Err is why the node gave no AdvertiseAck (it wraps
	// ErrCheckUnreachable); nil when it answered.
	Err error
}

// RejectedRoute is a route a node rejected.
type RejectedRoute struct {
	Name       string
	ListenPort int // 0 unless the route is a listen-port route
	Reason     string
}

// RouteOverlap is a route of the agent that an agent of another
// credential serves too; Shadowed when that one comes first in routing
// order (lb_policy first routes nothing to this agent).
type RouteOverlap struct {
	Route           string
	OtherCredential string
	OtherAgentID    string
	Shadowed        bool
}

// Err summarises the result: nil when every node accepted every route;
// otherwise an error that wraps ErrCheckUnreachable when a node was not
// reached (which takes precedence), else ErrCheckRejected, and names the
// nodes and routes.
func (r CheckResult) Err() error {
	var unreachable, rejected []error
	for _, n := range r.Nodes {
		switch {
		case n.Err != nil:
			unreachable = append(unreachable, fmt.Errorf("%s: %w", n.Server, n.Err))
		case len(n.Rejected) > 0:
			for _, rj := range n.Rejected {
				rejected = append(rejected, fmt.Errorf("%w: %s on node %s: %s", ErrCheckRejected, rj.Name, n.NodeID, rj.Reason))
			}
		}
	}
	if len(unreachable) > 0 {
		return errors.Join(unreachable...)
	}
	return errors.Join(rejected...)
}

// Check connects to the node of cfg (with server_each_address, to each
// address of the server's name) as the agent would, authenticates,
// advertises the configured routes and reports what each node accepted
// and rejected; then it leaves each node as sluice-agent does on SIGTERM
// and returns. It does not follow the cluster membership a node pushes:
// it checks the nodes the configuration names.
//
// The check advertises under an id of its own, derived from cfg.ID, so
// that it never displaces a running agent of that id (the node keeps one
// session per id). While its session lasts the node may route a
// connection to it, which it serves from the configured upstreams like
// the agent; it then withdraws its routes (Drain) at once.
//
// The error is about the configuration alone (it is invalid, or its files
// cannot be read); what the nodes answered, or that they could not be
// reached, is in the result (CheckResult.Err). A nil logger logs nothing.
func Check(ctx context.Context, cfg *Config, logger *zap.Logger) (CheckResult, error) {
	if cfg == nil {
		return CheckResult{}, errors.New("agent: nil config")
	}
	if err := cfg.Validate(); err != nil {
		return CheckResult{}, err
	}
	c := *cfg
	c.ID = checkID(cfg.ID)
	c.AdminListen = "" // a check serves no admin listener: it would compete with the agent's
	a, err := New(&c, logger)
	if err != nil {
		return CheckResult{}, err
	}
	res := CheckResult{AgentID: c.ID}
	targets, err := a.checkTargets(ctx)
	if err != nil {
		res.Nodes = []NodeCheck{{Server: c.Server, Err: fmt.Errorf("%w: %w", ErrCheckUnreachable, err)}}
		return res, nil
	}
	res.Nodes = make([]NodeCheck, len(targets))
	var wg sync.WaitGroup
	for i, t := range targets {
		wg.Go(func() { res.Nodes[i] = a.checkNode(ctx, t, cfg.ID) })
	}
	wg.Wait()
	if !a.conn.wait(shutdownWait) {
		a.log.Warn("connections still open at the end of the check", zap.Int("connections", a.conn.Active()))
	}
	return res, nil
}

// checkID is the id a check advertises under: id with a random suffix,
// within the length the node accepts. It sorts after id, as the node
// orders agents (byte-wise), so that the running agent of id keeps what
// the smallest id gets: its listen ports, its traffic under lb_policy
// first. id plus the suffix does, having id as its prefix; an id too long
// for that is cut where a '~' (the greatest byte an id may hold) can
// replace a smaller byte.
func checkID(id string) string {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("agent: crypto/rand: " + err.Error())
	}
	suffix := "-check-" + hex.EncodeToString(b[:])
	keep := ident.MaxIDLength - len(suffix)
	if len(id) <= keep {
		return id + suffix
	}
	for k := keep - 1; k >= 0; k-- {
		if id[k] < '~' {
			return id[:k] + "~" + suffix
		}
	}
	return id[:keep] + suffix // all '~': nothing sorts after it within the length
}

// checkTargets are the nodes a check dials: the server, or with
// server_each_address each address its name resolves to now.
func (a *Agent) checkTargets(ctx context.Context) ([]*linkTarget, error) {
	if !a.cfg.ServerEachAddress {
		return []*linkTarget{serverTarget(a.cfg)}, nil
	}
	_, hostport := a.cfg.ServerAddr()
	host, port, err := net.SplitHostPort(hostport)
	if err != nil {
		return nil, fmt.Errorf("server %q: %w", a.cfg.Server, err)
	}
	addrs, err := a.cluster.resolveAddrs(ctx, host, port)
	if err != nil {
		return nil, err
	}
	out := make([]*linkTarget, len(addrs))
	for i, addr := range addrs {
		out[i] = addressTarget(a.cfg, addr)
	}
	return out, nil
}

// checkNode runs one session attempt with t through the agent's own
// connect path (link.connect: dial, stream, transport, Advertise,
// AdvertiseAck), records the ack, and leaves the node. self is the
// configured agent id the check stands in for.
func (a *Agent) checkNode(ctx context.Context, t *linkTarget, self string) NodeCheck {
	nc := NodeCheck{Server: t.url}
	l := newLink(a, originServer, t)
	defer func() {
		l.stopAgentLeave()
		l.end()
	}()
	s, ack, failed := l.connect(ctx, t)
	defer s.close()
	if failed != nil {
		useTLS, _ := a.cfg.ServerAddr()
		nc.Err = checkConnectError(failed.err, useTLS)
		return nc
	}
	nc.NodeID, nc.NodeBuild, nc.Credential = ack.GetNodeId(), ack.GetBuild(), ack.GetCredential()
	for _, k := range ack.GetAccepted() {
		nc.Accepted = append(nc.Accepted, k.GetName())
	}
	nc.Rejected, nc.HeldByAgent = splitRejected(ack.GetRejected(), self)
	for _, o := range ack.GetOverlaps() {
		nc.Overlaps = append(nc.Overlaps, RouteOverlap{Route: o.GetName(), OtherCredential: o.GetOtherCredential(),
			OtherAgentID: o.GetOtherAgentId(), Shadowed: o.GetShadowed()})
	}
	wait := s.acceptConns()
	defer wait() // after the session ended (leaveAfterCheck)
	s.leaveAfterCheck(ctx)
	return nc
}

// splitRejected sorts a node's rejections into the real ones and those of
// listen ports the agent self holds (see NodeCheck.HeldByAgent).
func splitRejected(rejected []*tunnelpb.RejectedRoute, self string) (refused, held []RejectedRoute) {
	for _, rj := range rejected {
		r := RejectedRoute{Name: rj.GetName(), ListenPort: int(rj.GetListenPort()), Reason: rj.GetReason()}
		if port := rj.GetListenPort(); port != 0 && r.Reason == tunnelpb.PortHeldReason(port, self) {
			held = append(held, r)
			continue
		}
		refused = append(refused, r)
	}
	return refused, held
}

// leaveAfterCheck leaves the node as the agent does on SIGTERM: Drain,
// then the node ends the session once no connection is open. Past
// checkLeaveGrace (or the agent's shutdown grace, if shorter) the check
// ends the session itself.
func (s *sessionAttempt) leaveAfterCheck(ctx context.Context) {
	grace, cancel := context.WithTimeout(ctx, min(s.a.cfg.ShutdownGrace, checkLeaveGrace))
	defer cancel()
	s.l.leave(grace, "check done")
	s.l.startLeaving(s.sess)
	select {
	case <-s.sess.Done():
	case <-grace.Done():
		s.sess.CloseWithError(errLeft)
	}
}

// checkConnectError explains why a check got no AdvertiseAck: the
// node's refusal of the credential, or a connection problem with the hint
// the agent logs for it.
func checkConnectError(err error, useTLS bool) error {
	code, msg := statusOf(err)
	switch code {
	case codes.Unauthenticated:
		return fmt.Errorf("%w: authentication failed (check token, token_file or the client certificate): %s", ErrCheckUnreachable, msg)
	case codes.PermissionDenied:
		return fmt.Errorf("%w: the node refused the agent: %s", ErrCheckUnreachable, msg)
	}
	if hint := connectHint(msg, useTLS); hint != "" {
		return fmt.Errorf("%w: %w (%s)", ErrCheckUnreachable, err, hint)
	}
	return fmt.Errorf("%w: %w", ErrCheckUnreachable, err)
}

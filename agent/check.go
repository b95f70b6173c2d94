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
		wg.Go(func() { res.Nodes[i] = a.checkNode(ctx, t) })
	}
	wg.Wait()
	if !a.conn.wait(shutdownWait) {
		a.log.Warn("connections still open at the end of the check", zap.Int("connections", a.conn.Active()))
	}
	return res, nil
}

// checkID is the id a check advertises under: id with a random suffix,
// within the length the node accepts.
func checkID(id string) string {
	var b [4]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic("agent: crypto/rand: " + err.Error())
	}
	suffix := "-check-" + hex.EncodeToString(b[:])
	return id[:min(len(id), ident.MaxIDLength-len(suffix))] + suffix
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
// handshake (dial, stream, transport, Advertise, AdvertiseAck), records
// the ack, and leaves the node.
func (a *Agent) checkNode(ctx context.Context, t *linkTarget) NodeCheck {
	nc := NodeCheck{Server: t.url}
	l := newLink(a, originServer, t)
	defer func() {
		l.stopAgentLeave()
		l.end()
	}()
	s := &sessionAttempt{a: a, l: l, t: t, runCtx: ctx}
	defer s.close()
	ack, failed := s.handshake()
	if failed != nil {
		useTLS, _ := a.cfg.ServerAddr()
		nc.Err = checkConnectError(failed.err, useTLS)
		return nc
	}
	nc.NodeID, nc.NodeBuild, nc.Credential = ack.GetNodeId(), ack.GetBuild(), ack.GetCredential()
	for _, k := range ack.GetAccepted() {
		nc.Accepted = append(nc.Accepted, k.GetName())
	}
	for _, rj := range ack.GetRejected() {
		nc.Rejected = append(nc.Rejected, RejectedRoute{Name: rj.GetName(), ListenPort: int(rj.GetListenPort()), Reason: rj.GetReason()})
	}
	for _, o := range ack.GetOverlaps() {
		nc.Overlaps = append(nc.Overlaps, RouteOverlap{Route: o.GetName(), OtherCredential: o.GetOtherCredential(),
			OtherAgentID: o.GetOtherAgentId(), Shadowed: o.GetShadowed()})
	}
	wait := s.acceptConns()
	defer wait() // after the session ended (leaveAfterCheck)
	s.leaveAfterCheck(ctx)
	return nc
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

package caddymodule

import (
	"cmp"
	"errors"
	"fmt"
	"net"
	"net/url"
	"slices"
	"strconv"
	"strings"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/ident"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Cluster makes this node one of several that serve the same agents: every
// agent keeps a session with every member, so any member serves any route
// and the members share nothing but Caddy's storage (certificates). The
// node tells each agent the members (a MembershipUpdate after its
// AdvertiseAck, and again when a reload changes them), and the agent opens
// a session to each. ListNodes answers with them too.
//
// A cluster needs node_id (this node's id among the members) and an
// explicit token, token_file or credentials: a token generated on each node
// would differ between them, and an agent brings one to every node.
type Cluster struct {
	// Nodes are the members: at most 64, ids unique. This node (node_id)
	// is always one: when the list does not name it, it is added with an
	// empty url, which agents read as "where you reached the node that
	// told you".
	Nodes []ClusterNode `json:"nodes,omitempty"`
}

// ClusterNode is one member of a cluster.
type ClusterNode struct {
	// ID is the member's node_id: printable ASCII without spaces, at most
	// 128 bytes.
	ID string `json:"id"`

	// URL is the control address agents dial for the member,
	// grpc://host:port or grpcs://host:port. It may be empty only for
	// this node (agents then reach it where they reached it).
	URL string `json:"url,omitempty"`
}

// maxClusterNodes bounds the members: each is a session every agent keeps
// open.
const maxClusterNodes = 64

// membership is a cluster's members as the node tells agents of them,
// sorted by id (so every member sends the same list, whatever order its
// config names them in). Immutable once made.
type membership struct {
	nodes []*tunnelpb.Node
	key   string // the members as one comparable string; "" never
}

// errClusterToken: cluster mode without a credential the operator chose.
var errClusterToken = errors.New("a cluster needs an explicit token, token_file or credentials: " +
	"a token generated on each node would differ between them, and agents connect to every node")

// provisionCluster checks the cluster settings and makes the membership.
// It runs before node_id gets its default: a cluster needs it set.
func (a *App) provisionCluster() error {
	if a.Cluster == nil {
		return nil
	}
	if a.NodeID == "" {
		return errors.New("sluice: node_id: required with cluster (this node's id among the members; no host-name default)")
	}
	if err := checkMemberID(a.NodeID); err != nil {
		return fmt.Errorf("sluice: node_id: %w", err)
	}
	if a.Token == "" && a.TokenFile == "" && len(a.Credentials) == 0 && a.ClientAuth == nil {
		return fmt.Errorf("sluice: token: %w", errClusterToken)
	}
	m, err := a.Cluster.membership(a.NodeID)
	if err != nil {
		return fmt.Errorf("sluice: cluster: %w", err)
	}
	a.members = m
	return nil
}

// membership checks the members and returns them with the local node
// among them.
func (c *Cluster) membership(localID string) (*membership, error) {
	seen := make(map[string]bool, len(c.Nodes)+1)
	nodes := make([]*tunnelpb.Node, 0, len(c.Nodes)+1)
	for i, cn := range c.Nodes {
		if err := checkMemberID(cn.ID); err != nil {
			return nil, fmt.Errorf("nodes[%d]: id: %w", i, err)
		}
		if seen[cn.ID] {
			return nil, fmt.Errorf("nodes[%d]: id: %q is listed twice", i, cn.ID)
		}
		seen[cn.ID] = true
		if err := checkMemberURL(cn, localID); err != nil {
			return nil, fmt.Errorf("nodes[%d] (%s): url: %w", i, cn.ID, err)
		}
		nodes = append(nodes, &tunnelpb.Node{Id: cn.ID, Url: cn.URL})
	}
	if !seen[localID] {
		nodes = append(nodes, &tunnelpb.Node{Id: localID})
	}
	if len(nodes) > maxClusterNodes {
		return nil, fmt.Errorf("nodes: %d members (this node included), at most %d", len(nodes), maxClusterNodes)
	}
	slices.SortFunc(nodes, func(x, y *tunnelpb.Node) int { return cmp.Compare(x.GetId(), y.GetId()) })
	var key strings.Builder
	for _, n := range nodes {
		key.WriteString(n.GetId() + "\x00" + n.GetUrl() + "\n")
	}
	return &membership{nodes: nodes, key: key.String()}, nil
}

// checkMemberID accepts a member id as an agent id is accepted: agents log
// it and key their sessions by it.
func checkMemberID(id string) error {
	if id == "" {
		return errors.New("empty")
	}
	return ident.CheckID(id)
}

// checkMemberURL accepts cn's url as the agent accepts its server url, so
// no member is one agents cannot dial; only the local node may leave it
// empty.
func checkMemberURL(cn ClusterNode, localID string) error {
	if cn.URL == "" {
		if cn.ID == localID {
			return nil
		}
		return errors.New("required (only this node, node_id, may leave it empty)")
	}
	return checkControlURL(cn.URL)
}

// checkControlURL accepts grpc://host:port and grpcs://host:port with
// nothing else: what the agent's server setting takes.
func checkControlURL(s string) error {
	if !strings.Contains(s, "//") {
		return fmt.Errorf("%q has no scheme (want grpc://host:port or grpcs://host:port)", s)
	}
	u, err := url.Parse(s)
	if err != nil {
		return fmt.Errorf("%q: %w", s, err)
	}
	switch scheme := strings.ToLower(u.Scheme); {
	case scheme != "grpc" && scheme != "grpcs":
		return fmt.Errorf("%q: scheme %q (want grpc or grpcs)", s, u.Scheme)
	case u.Opaque != "" || u.Host == "":
		return fmt.Errorf("%q has no host (want %s://host:port)", s, scheme)
	case u.User != nil, u.Path != "" && u.Path != "/", u.RawQuery != "" || u.ForceQuery, u.Fragment != "":
		return fmt.Errorf("%q: only %s://host:port (no user, path, query or fragment)", s, scheme)
	}
	host, port, err := net.SplitHostPort(u.Host)
	if err != nil || host == "" {
		return fmt.Errorf("%q: want host:port after the scheme", s)
	}
	if p, err := strconv.Atoi(port); err != nil || p < 1 || p > 65535 {
		return fmt.Errorf("%q: invalid port %q", s, port)
	}
	return nil
}

// list returns the members for a message: fresh values, since frames are
// marshalled on each session's own goroutine. nil m is a node without a
// cluster, which is its own only member (localID, reached where the agent
// reached it).
func (m *membership) list(localID string) []*tunnelpb.Node {
	if m == nil {
		return []*tunnelpb.Node{{Id: localID}}
	}
	out := make([]*tunnelpb.Node, len(m.nodes))
	for i, n := range m.nodes {
		out[i] = &tunnelpb.Node{Id: n.GetId(), Url: n.GetUrl()}
	}
	return out
}

// keyOf is m's key; "" without a cluster.
func (m *membership) keyOf() string {
	if m == nil {
		return ""
	}
	return m.key
}

// sendMembershipLocked tells a the members unless it knows them already
// (agentSession.members). A session of a node without a cluster is told
// nothing, unless an earlier config told it of one: it then learns the
// node is alone. It reports whether it sent. Callers hold admitMu.
func (n *node) sendMembershipLocked(a *agentSession, opts *nodeOptions) bool {
	key := opts.cluster.keyOf()
	if key == a.members || a.leaving.Load() {
		return false
	}
	a.members = key
	a.sess.SendControl(&tunnelpb.Frame{Kind: &tunnelpb.Frame_MembershipUpdate{MembershipUpdate: &tunnelpb.MembershipUpdate{
		// Without a cluster the node lists itself as its acks name it, so
		// the agent finds the sender in the list and takes it.
		Nodes: opts.cluster.list(n.ackNodeID(opts)),
	}}})
	return true
}

// pushMembership tells every session the members, if the config that just
// took over (or came back, a start rolled back) changed them. Sessions
// registered meanwhile learnt them with their AdvertiseAck and are not
// told twice.
func (n *node) pushMembership() {
	n.admitMu.Lock()
	defer n.admitMu.Unlock()
	opts := n.opts.Load()
	told := 0
	for _, a := range n.reg.sessions() {
		if n.sendMembershipLocked(a, opts) {
			told++
		}
	}
	if told > 0 {
		n.log().Info("cluster membership changed; agents told", zap.Strings("members", memberIDs(opts.cluster)), zap.Int("sessions", told))
	}
}

// memberIDs lists m's ids for a log line.
func memberIDs(m *membership) []string {
	if m == nil {
		return nil
	}
	ids := make([]string, len(m.nodes))
	for i, n := range m.nodes {
		ids[i] = n.GetId()
	}
	return ids
}

// members is what ListNodes answers: the cluster's members, or this node
// alone (its node_id, an empty url).
func (n *node) members() []*tunnelpb.Node {
	opts := n.opts.Load()
	return opts.cluster.list(nodeID(n))
}

// ackNodeID is the node_id an AdvertiseAck carries: in a cluster the
// member id, so an agent finds the node that answered among the members
// it is told of (its url there may differ from the one the agent dialed);
// else node_id (the host name by default) and the control listener's
// address: the address alone (":8001" listens on "[::]:8001" everywhere)
// would make identical nodes behind one DNS name look like one node to an
// agent keeping a session per address (server_each_address).
func (n *node) ackNodeID(opts *nodeOptions) string {
	if opts.cluster != nil {
		return opts.nodeID
	}
	if opts.nodeID == "" {
		return n.id
	}
	return opts.nodeID + "@" + n.id
}

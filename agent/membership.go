package agent

import (
	"errors"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"

	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/internal/ident"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// The membership the nodes push (proto/README §13): each MembershipUpdate
// lists the cluster's members, each with its id and the URL agents dial
// (grpc:// or grpcs://); the node that sends it may list itself without a
// URL, and is then reached where its link dials.
//
// Which update wins when nodes disagree (during a rolling reload, the
// nodes reloaded first list the new membership and the others the old):
// the most recent update from a node that is a current member of the
// membership applied before, that lists itself. The first update is taken
// from whichever node sends it. An update from a node the membership no
// longer lists, or that does not list itself, changes nothing: a node
// removed from the cluster cannot pull the agent back to the old one, and
// once every node reloaded, every update agrees. An update without any
// usable member is ignored too, so the agent always keeps a link. One
// exception: while no link to a member has a session, an update from any
// node is taken, as the cluster may have moved as a whole, and the
// server's link found it again through the server setting
// (link.nextTarget).

// maxMembersRead bounds the entries of a MembershipUpdate the agent reads;
// it keeps maxLinks of them.
const maxMembersRead = 4 * maxLinks

// member is one entry of a MembershipUpdate, as received.
type member struct{ id, url string }

// membership is the membership the agent applies: the members' ids in
// the update's order, and their URLs, normalised ("" where none is known:
// the sender's own entry, reached where its link dials, or an entry whose
// URL was not usable). A URL an earlier update gave is kept when a later
// one gives none.
type membership struct {
	ids  []string
	urls map[string]string
}

func (m *membership) has(id string) bool {
	if m == nil {
		return false
	}
	_, ok := m.urls[id]
	return ok
}

// equal reports whether m and o list the same members at the same URLs.
func (m *membership) equal(o *membership) bool {
	if m == nil || o == nil {
		return m == o
	}
	if len(m.urls) != len(o.urls) {
		return false
	}
	for id, u := range m.urls {
		if ou, ok := o.urls[id]; !ok || ou != u {
			return false
		}
	}
	return true
}

// names lists the members as id=url (id alone without a URL), for logs.
func (m *membership) names() []string {
	out := make([]string, 0, len(m.ids))
	for _, id := range m.ids {
		if u := m.urls[id]; u != "" {
			out = append(out, id+"="+u)
		} else {
			out = append(out, id)
		}
	}
	return out
}

// membershipProblem is a member the agent cannot use, to log once.
type membershipProblem struct {
	msg    string
	fields []zap.Field
}

// parseMembership reads the members nodes that node sender sent, over
// prev (the membership applied before, nil if none): each id must be
// printable ASCII, each URL grpc:// or grpcs:// with host:port and with
// the TLS-ness of the server setting (checkMemberURL). It returns nil
// when the update lists no usable member or not its sender, and the
// problems found either way.
func parseMembership(sender string, nodes []member, prev *membership, wantTLS bool) (*membership, []membershipProblem) {
	m := &membership{urls: map[string]string{}}
	var problems []membershipProblem
	problem := func(msg string, fields ...zap.Field) {
		problems = append(problems, membershipProblem{msg: msg, fields: fields})
	}
	for _, n := range nodes {
		if err := checkMemberID(n.id); err != nil {
			problem("membership: a member's id is not usable; member skipped", zap.Error(err))
			continue
		}
		if m.has(n.id) {
			continue // listed twice: the first entry counts
		}
		if len(m.ids) == maxLinks {
			problem(fmt.Sprintf("membership lists more than %d nodes; the agent keeps sessions with the first %d", maxLinks, maxLinks),
				zap.Int("listed", len(nodes)))
			break
		}
		url, err := checkMemberURL(n.url, wantTLS)
		if err != nil {
			problem("membership: a member's url is not usable", zap.String("member", n.id), zap.Error(err))
		}
		if url == "" && prev != nil {
			url = prev.urls[n.id]
		}
		m.ids = append(m.ids, n.id)
		m.urls[n.id] = url
	}
	if !m.has(sender) {
		problem("membership update ignored: it does not list the node that sent it", zap.String("from_node", sender))
		return nil, problems
	}
	return m, problems
}

// checkMemberID checks a member's id as the node's own AdvertiseAck
// carries it: non-empty printable ASCII of at most ident.MaxIDLength
// bytes.
func checkMemberID(id string) error {
	if id == "" {
		return errors.New("empty")
	}
	if err := ident.CheckID(id); err != nil {
		return fmt.Errorf("node id: %w", err)
	}
	return nil
}

// checkMemberURL normalises a member's URL ("" stays "": the sender's own
// entry). Every node is reached as the server setting says, with TLS or
// without: a grpc:// member of a grpcs:// cluster would send the token in
// clear, and a grpcs:// member of a grpc:// cluster has no trust settings
// (ca_file) configured for it.
func checkMemberURL(raw string, wantTLS bool) (string, error) {
	if raw == "" {
		return "", nil
	}
	scheme, hostport, err := parseURL(raw, "grpc or grpcs", "grpc", "grpcs")
	if err != nil {
		return "", fmt.Errorf("url: %w", err)
	}
	if want := schemeOf(wantTLS); scheme != want {
		return "", fmt.Errorf("url %q: the server is %s://, and every node is reached with the same TLS-ness", raw, want)
	}
	return scheme + "://" + strings.ToLower(hostport), nil
}

// schemeOf is the scheme of a server with TLS or without.
func schemeOf(useTLS bool) string {
	if useTLS {
		return "grpcs"
	}
	return "grpc"
}

// splitScheme splits a normalised URL into scheme and host:port.
func splitScheme(url string) (scheme, hostport string, ok bool) {
	return strings.Cut(url, "://")
}

// memberNames lists an update's entries as id=url, at most
// maxMembersRead of them, for logs.
func memberNames(nodes []*tunnelpb.Node) []string {
	out := make([]string, 0, min(len(nodes), maxMembersRead))
	for _, n := range nodes[:min(len(nodes), maxMembersRead)] {
		out = append(out, n.GetId()+"="+n.GetUrl())
	}
	return out
}

// membershipOffer is a MembershipUpdate a session received, for the
// cluster's manager.
type membershipOffer struct {
	seq    uint64 // arrival order
	from   *link
	dialed *linkTarget // where from's session dialed
	sender string      // the id of the node that sent it
	nodes  []member
}

// membershipBox holds the newest MembershipUpdate of each link until the
// manager takes them: the session's receive loop offers without blocking,
// and the manager applies them in the order they came. Holding one per
// link bounds it, and loses no update that a later one from another link
// would not supersede.
type membershipBox struct {
	ready chan struct{} // has a value while offers wait

	mu     sync.Mutex
	seq    uint64
	offers map[*link]membershipOffer
}

// offer puts the update m that node sender sent on l's session to t.
func (c *cluster) offer(l *link, t *linkTarget, sender string, m *tunnelpb.MembershipUpdate) {
	nodes := m.GetNodes()
	o := membershipOffer{from: l, dialed: t, sender: sender, nodes: make([]member, 0, min(len(nodes), maxMembersRead+1))}
	for _, n := range nodes[:min(len(nodes), maxMembersRead+1)] {
		o.nodes = append(o.nodes, member{id: n.GetId(), url: n.GetUrl()})
	}
	b := &c.box
	b.mu.Lock()
	b.seq++
	o.seq = b.seq
	b.offers[l] = o
	b.mu.Unlock()
	select {
	case b.ready <- struct{}{}:
	default:
	}
}

// take returns the waiting offers in arrival order.
func (b *membershipBox) take() []membershipOffer {
	b.mu.Lock()
	out := make([]membershipOffer, 0, len(b.offers))
	for _, o := range b.offers {
		out = append(out, o)
	}
	clear(b.offers)
	b.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].seq < out[j].seq })
	return out
}

// apply applies an update, if it comes from a member (see the rule
// above), and reconciles the links with it.
func (c *cluster) apply(o membershipOffer) {
	if c.a.cfg.ServerEachAddress {
		c.logUnused(o)
		return
	}
	if !c.fromMember(o) {
		o.from.log().Debug("membership update from a node that is not a member ignored", zap.String("from_node", o.sender))
		return
	}
	m, problems := parseMembership(o.sender, o.nodes, c.members, c.a.cfg.serverTLS)
	for _, p := range problems {
		c.warnOnce(p.msg, p.fields...)
	}
	if m == nil {
		return
	}
	if !m.equal(c.members) {
		c.a.log.Info("cluster membership", zap.String("from_node", o.sender), zap.Strings("nodes", m.names()))
	}
	c.members = m
	c.reconcile()
}

// fromMember reports whether o may change the membership: its link is
// still one of the cluster's, and its sender a member; any node before
// the first membership, or while no link to a member has a session (the
// cluster moved: the server's link found it again through the server
// setting, link.nextTarget). The update may come before the session's
// AdvertiseAck reached the link's claim (they travel apart): the link is
// keyed by its sender first, so that reconcile finds the sender's link.
func (c *cluster) fromMember(o membershipOffer) bool {
	if o.sender == "" {
		return false
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	e := c.entryLocked(o.from)
	if e == nil || e.l.leaving() {
		return false
	}
	dialsServer := e.l.origin == originServer && o.dialed.member == ""
	if (e.key == "" || dialsServer) && c.servedByOtherLocked(e, o.sender) == nil {
		e.key, e.nodeID = o.sender, o.sender
	}
	return c.members == nil || c.members.has(o.sender) || !c.memberUpLocked()
}

// memberUpLocked reports whether a link to a member has a session. c.mu
// is held.
func (c *cluster) memberUpLocked() bool {
	for _, e := range c.entries {
		if c.members.has(e.key) && sessionUp(e.l.state()) {
			return true
		}
	}
	return false
}

// logUnused logs a membership that server_each_address does not use: at
// info when it differs from the one logged before.
func (c *cluster) logUnused(o membershipOffer) {
	names := make([]string, 0, len(o.nodes))
	for _, n := range o.nodes {
		names = append(names, n.id+"="+n.url)
	}
	slices.Sort(names)
	lvl := c.a.log.Debug
	if key := strings.Join(names, " "); key != c.others {
		c.others = key
		lvl = c.a.log.Info
	}
	lvl("membership update not used: the server's addresses are the membership (server_each_address)",
		zap.String("from_node", o.sender), zap.Strings("nodes", names))
}

// reconcile opens a link for each member without one, points the links
// of members whose URL became known at it, and leaves the members no
// longer listed. It never leaves the last link, nor any while no link to
// a member has a session: the server's link may just have found the
// cluster again elsewhere (link.nextTarget), and the node it reached
// tells the new membership next. A link not yet keyed (the server's,
// before its node answered) stays.
func (c *cluster) reconcile() {
	m := c.members
	if m == nil {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	for _, id := range m.ids {
		c.ensureLocked(id, m.urls[id])
	}
	if !c.memberUpLocked() {
		return
	}
	for _, e := range slices.Clone(c.entries) {
		if !e.l.leaving() && e.key != "" && !m.has(e.key) && c.activeLocked() > 1 {
			c.retireLocked(e, "the node left the cluster's membership")
		}
	}
}

// ensureLocked gives member id at url (normalised; "" when unknown) its
// link. c.mu is held.
func (c *cluster) ensureLocked(id, url string) {
	e := c.keyedLocked(id)
	switch {
	case e != nil:
		if t := e.l.target.Load(); url != "" && (t.url != url || t.member != id) {
			e.l.retarget(memberTarget(id, url))
		}
	case url == "":
		c.warnOnce("membership: no URL known for a member; no session with it until a node tells its URL", zap.String("member", id))
	default:
		c.openLocked(memberTarget(id, url), originMember, id)
	}
}

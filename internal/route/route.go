// Package route owns the kinds of route an agent advertises: which
// combinations of a tunnelpb.Route's fields make which kind (Classify), and
// the name a route goes by (Name, proto/README §12.1).
//
// The agent's configuration checks and the node's route table both decide a
// route's kind here and switch on it, so the two sides cannot disagree on,
// say, whether a hostless tcp:// route is a named service or the catch-all,
// and a new kind is one new case here plus its handlers.
package route

import (
	"strconv"
	"strings"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Kind is how a route is reached: by HTTP host, by TLS server name, by its
// name alone or by a port of the node; and what it carries: HTTP requests,
// TCP connections or (NamedUDP, UDPListenPort) datagram flows.
type Kind uint8

// The kinds of route. Invalid is Classify's answer for a route whose fields
// make no kind.
const (
	Invalid Kind = iota
	// Host takes HTTP requests for one exact host (http:// or https://
	// target).
	Host
	// HostPattern takes HTTP requests for the hosts its pattern matches.
	HostPattern
	// CatchAll takes HTTP requests for every host no other route serves:
	// no host, pattern or port, and a target other than tcp://, or a
	// tcp:// one named "*" (Caddy may speak TLS to the upstream through it).
	CatchAll
	// TCPHost is a tcp:// target by exact host: it takes HTTP requests for
	// the host (Caddy speaks HTTP or TLS to it), and raw TCP connections
	// by TLS server name once layer4's tls handler terminated TLS.
	TCPHost
	// TCPHostPattern is TCPHost by host pattern.
	TCPHostPattern
	// PassthroughHost takes raw TLS connections by exact server name (the
	// upstream terminates TLS); never HTTP.
	PassthroughHost
	// PassthroughPattern is PassthroughHost by host pattern.
	PassthroughPattern
	// NamedTCP is a raw TCP service (Redis, say) reached by its name alone,
	// from layer4's `sluice NAME`: a tcp:// target, no host, pattern or
	// port, and a name other than "*". Taken as the HTTP catch-all it
	// would be sent the requests for every host no other route serves.
	NamedTCP
	// ListenPort takes the raw TCP connections of one port of the node;
	// never host or SNI routing.
	ListenPort
	// NamedUDP is a UDP service (DNS, a game server) reached by its name
	// alone, from layer4's `sluice NAME` on a UDP server: a udp:// target,
	// no port, and a name other than "*". Its client addresses' datagrams
	// travel in datagram flows (proto/README §6.1).
	NamedUDP
	// UDPListenPort takes the datagrams of one UDP port of the node, in a
	// flow per client address; never host or SNI routing.
	UDPListenPort
)

// Kinds returns every valid kind, in declaration order: tests and docs
// walk it to cover each.
func Kinds() []Kind {
	return []Kind{Host, HostPattern, CatchAll, TCPHost, TCPHostPattern, PassthroughHost, PassthroughPattern, NamedTCP, ListenPort, NamedUDP, UDPListenPort}
}

// String names the kind for logs and docs.
func (k Kind) String() string {
	switch k {
	case Host:
		return "host"
	case HostPattern:
		return "host pattern"
	case CatchAll:
		return "catch-all"
	case TCPHost:
		return "tcp host"
	case TCPHostPattern:
		return "tcp host pattern"
	case PassthroughHost:
		return "tls passthrough host"
	case PassthroughPattern:
		return "tls passthrough pattern"
	case NamedTCP:
		return "named tcp service"
	case ListenPort:
		return "listen port"
	case NamedUDP:
		return "named udp service"
	case UDPListenPort:
		return "udp listen port"
	case Invalid:
		return "invalid"
	}
	return "Kind(" + strconv.Itoa(int(k)) + ")"
}

// TakesHTTP reports whether routes of the kind serve HTTP requests by
// host, and so take the HTTP options (rewrite_host, force_http1).
func (k Kind) TakesHTTP() bool {
	switch k {
	case Host, HostPattern, CatchAll, TCPHost, TCPHostPattern:
		return true
	}
	return false
}

// Datagram reports whether routes of the kind carry UDP datagrams in
// datagram flows rather than connections.
func (k Kind) Datagram() bool {
	return k == NamedUDP || k == UDPListenPort
}

// Classify returns the kind of rt. A route whose fields do not make one
// kind is Invalid with an *InvalidError naming the fields. It does not
// check the fields' values (a host's syntax, a pattern, a port's range):
// those are each side's own checks.
func Classify(rt *tunnelpb.Route) (Kind, error) {
	if err := checkCombination(rt); err != nil {
		return Invalid, err
	}
	host, pattern, tcp := rt.GetHost() != "", rt.GetHostPattern() != "", IsTCPTarget(rt.GetTarget())
	udp := IsUDPTarget(rt.GetTarget())
	switch {
	case udp && rt.GetListenPort() != 0:
		return UDPListenPort, nil
	case udp:
		return NamedUDP, nil
	case rt.GetListenPort() != 0:
		return ListenPort, nil
	case rt.GetTlsPassthrough() && host:
		return PassthroughHost, nil
	case rt.GetTlsPassthrough():
		return PassthroughPattern, nil
	case host && tcp:
		return TCPHost, nil
	case host:
		return Host, nil
	case pattern && tcp:
		return TCPHostPattern, nil
	case pattern:
		return HostPattern, nil
	case tcp && Name(rt) != "*":
		return NamedTCP, nil
	default:
		return CatchAll, nil
	}
}

// checkCombination reports the fields of rt that exclude or require one
// another: a listen port is routed by nothing else, a route has a host or
// a pattern, and passthrough is routed by server name, so it needs one. A
// udp:// target is routed by name or port alone (UDP has no host or server
// name to route by), and needs one of them.
func checkCombination(rt *tunnelpb.Route) error {
	var e InvalidError
	host, pattern := rt.GetHost() != "", rt.GetHostPattern() != ""
	if IsUDPTarget(rt.GetTarget()) {
		checkUDP(rt, &e)
	}
	if host && pattern {
		e.add("host_pattern", "host and host_pattern are mutually exclusive")
	}
	if rt.GetTlsPassthrough() && !host && !pattern {
		e.add("tls_passthrough", "requires host or host_pattern")
	}
	if rt.GetListenPort() != 0 {
		for _, f := range []struct {
			set  bool
			name string
		}{{host, "host"}, {pattern, "host_pattern"}, {rt.GetTlsPassthrough(), "tls_passthrough"}} {
			if f.set {
				e.add("listen_port", "cannot be combined with "+f.name)
			}
		}
	}
	if len(e.Problems) > 0 {
		return &e
	}
	return nil
}

// checkUDP adds the problems of a udp:// route's fields to e: a host,
// pattern or passthrough (UDP carries no host name or TLS server name to
// route by), or neither a name nor a port to be reached by. The name "*"
// is the catch-all's, which no datagram flow is routed to.
func checkUDP(rt *tunnelpb.Route, e *InvalidError) {
	for _, f := range []struct {
		set  bool
		name string
	}{{rt.GetHost() != "", "host"}, {rt.GetHostPattern() != "", "host_pattern"}, {rt.GetTlsPassthrough(), "tls_passthrough"}} {
		if f.set {
			e.add(f.name, "cannot be combined with a udp:// target")
		}
	}
	if rt.GetListenPort() == 0 && Name(rt) == "*" {
		e.add("target", `a udp:// target needs a name other than "*" or a listen_port`)
	}
}

// IsTCPTarget reports whether target is tcp://, which marks a route the
// agent relays verbatim: one of the two parts of the target the node reads.
func IsTCPTarget(target string) bool {
	return strings.HasPrefix(target, "tcp://")
}

// IsUDPTarget reports whether target is udp://, which marks a route whose
// clients' datagrams travel in datagram flows: the other part of the
// target the node reads.
func IsUDPTarget(target string) bool {
	return strings.HasPrefix(target, "udp://")
}

// Name is the name rt goes by in AdvertiseAck, RejectedRoute and
// Connect.route_key: its name, else its host, host pattern,
// ":<listen_port>", else "*" (the catch-all).
func Name(rt *tunnelpb.Route) string {
	switch {
	case rt.GetName() != "":
		return rt.GetName()
	case rt.GetHost() != "":
		return rt.GetHost()
	case rt.GetHostPattern() != "":
		return rt.GetHostPattern()
	case rt.GetListenPort() != 0:
		return ":" + strconv.Itoa(int(rt.GetListenPort()))
	default:
		return "*"
	}
}

// Problem is one invalid combination of fields: Field is the field it is
// reported on, Msg what is wrong with it ("cannot be combined with host").
type Problem struct {
	Field, Msg string
}

// InvalidError is Classify's error: every problem of the route's fields,
// so that a configuration reports them all at once.
type InvalidError struct {
	Problems []Problem
}

func (e *InvalidError) add(field, msg string) {
	e.Problems = append(e.Problems, Problem{Field: field, Msg: msg})
}

// Error joins the problems as "field: msg; field: msg", on one line (the
// node sends it as a rejection reason).
func (e *InvalidError) Error() string {
	parts := make([]string, len(e.Problems))
	for i, p := range e.Problems {
		parts[i] = p.Field + ": " + p.Msg
	}
	return strings.Join(parts, "; ")
}

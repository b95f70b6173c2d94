package route

import (
	"errors"
	"strings"
	"testing"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// TestClassify covers every kind, the field combinations that decide
// between neighbours (a tcp:// target, the name "*"), and checks that each
// kind of Kinds is covered.
func TestClassify(t *testing.T) {
	tests := []struct {
		name  string
		route *tunnelpb.Route
		want  Kind
	}{
		{"host", &tunnelpb.Route{Host: "a.test", Target: "http://x:1"}, Host},
		{"host https", &tunnelpb.Route{Host: "a.test", Target: "https://x:1"}, Host},
		{"host without target", &tunnelpb.Route{Host: "a.test"}, Host},
		{"host pattern", &tunnelpb.Route{HostPattern: `.*\.a\.test`, Target: "http://x:1"}, HostPattern},
		{"catch-all", &tunnelpb.Route{Target: "http://x:1"}, CatchAll},
		{"catch-all named", &tunnelpb.Route{Name: "web", Target: "http://x:1"}, CatchAll},
		{"empty route", &tunnelpb.Route{}, CatchAll},
		{"tcp catch-all named *", &tunnelpb.Route{Name: "*", Target: "tcp://x:1"}, CatchAll},
		{"tcp catch-all unnamed", &tunnelpb.Route{Target: "tcp://x:1"}, CatchAll},
		{"tcp host", &tunnelpb.Route{Host: "a.test", Target: "tcp://x:1"}, TCPHost},
		{"tcp host pattern", &tunnelpb.Route{HostPattern: `.*\.a\.test`, Target: "tcp://x:1"}, TCPHostPattern},
		{"passthrough host", &tunnelpb.Route{Host: "a.test", TlsPassthrough: true, Target: "tcp://x:1"}, PassthroughHost},
		{"passthrough pattern", &tunnelpb.Route{HostPattern: `.*\.a\.test`, TlsPassthrough: true, Target: "tcp://x:1"}, PassthroughPattern},
		{"passthrough, target not read", &tunnelpb.Route{Host: "a.test", TlsPassthrough: true, Target: "http://x:1"}, PassthroughHost},
		{"named tcp", &tunnelpb.Route{Name: "redis", Target: "tcp://x:1"}, NamedTCP},
		{"listen port", &tunnelpb.Route{ListenPort: 2222, Target: "tcp://x:1"}, ListenPort},
		{"listen port named", &tunnelpb.Route{Name: "ssh", ListenPort: 2222, Target: "tcp://x:1"}, ListenPort},
		{"upper-case scheme is not tcp", &tunnelpb.Route{Name: "x", Target: "TCP://x:1"}, CatchAll},
		{"named udp", &tunnelpb.Route{Name: "dns", Target: "udp://x:53"}, NamedUDP},
		{"udp listen port", &tunnelpb.Route{ListenPort: 5353, Target: "udp://x:53"}, UDPListenPort},
		{"udp listen port named", &tunnelpb.Route{Name: "dns", ListenPort: 5353, Target: "udp://x:53"}, UDPListenPort},
		{"udp listen port named *", &tunnelpb.Route{Name: "*", ListenPort: 5353, Target: "udp://x:53"}, UDPListenPort},
		{"upper-case scheme is not udp", &tunnelpb.Route{Name: "x", Target: "UDP://x:1"}, CatchAll},
	}
	covered := map[Kind]bool{}
	for _, tt := range tests {
		got, err := Classify(tt.route)
		if err != nil || got != tt.want {
			t.Errorf("%s: Classify = %v, %v; want %v", tt.name, got, err, tt.want)
		}
		covered[got] = true
	}
	for _, k := range Kinds() {
		if !covered[k] {
			t.Errorf("kind %v has no case in this test", k)
		}
	}
}

// TestClassifyInvalid: a combination that makes no kind is an
// *InvalidError naming each field at fault.
func TestClassifyInvalid(t *testing.T) {
	tests := []struct {
		name  string
		route *tunnelpb.Route
		want  []Problem
	}{
		{"host and pattern", &tunnelpb.Route{Host: "a.test", HostPattern: "b"},
			[]Problem{{"host_pattern", "host and host_pattern are mutually exclusive"}}},
		{"passthrough without host", &tunnelpb.Route{Name: "p", TlsPassthrough: true, Target: "tcp://x:1"},
			[]Problem{{"tls_passthrough", "requires host or host_pattern"}}},
		{"port and host", &tunnelpb.Route{Host: "a.test", ListenPort: 1},
			[]Problem{{"listen_port", "cannot be combined with host"}}},
		{"port and pattern", &tunnelpb.Route{HostPattern: "a", ListenPort: 1},
			[]Problem{{"listen_port", "cannot be combined with host_pattern"}}},
		{"port and passthrough", &tunnelpb.Route{TlsPassthrough: true, ListenPort: 1}, []Problem{
			{"tls_passthrough", "requires host or host_pattern"}, {"listen_port", "cannot be combined with tls_passthrough"}}},
		{"port, host and passthrough", &tunnelpb.Route{Host: "a.test", TlsPassthrough: true, ListenPort: 1}, []Problem{
			{"listen_port", "cannot be combined with host"}, {"listen_port", "cannot be combined with tls_passthrough"}}},
		{"udp with host", &tunnelpb.Route{Host: "a.test", Target: "udp://x:1"},
			[]Problem{{"host", "cannot be combined with a udp:// target"}}},
		{"udp with pattern", &tunnelpb.Route{Name: "n", HostPattern: "a", Target: "udp://x:1"},
			[]Problem{{"host_pattern", "cannot be combined with a udp:// target"}}},
		{"udp passthrough", &tunnelpb.Route{Host: "a.test", TlsPassthrough: true, Target: "udp://x:1"}, []Problem{
			{"host", "cannot be combined with a udp:// target"}, {"tls_passthrough", "cannot be combined with a udp:// target"}}},
		{"udp unnamed", &tunnelpb.Route{Target: "udp://x:1"},
			[]Problem{{"target", `a udp:// target needs a name other than "*" or a listen_port`}}},
		{"udp named *", &tunnelpb.Route{Name: "*", Target: "udp://x:1"},
			[]Problem{{"target", `a udp:// target needs a name other than "*" or a listen_port`}}},
	}
	for _, tt := range tests {
		k, err := Classify(tt.route)
		var ie *InvalidError
		if k != Invalid || !errors.As(err, &ie) {
			t.Errorf("%s: Classify = %v, %v; want Invalid, an *InvalidError", tt.name, k, err)
			continue
		}
		if len(ie.Problems) != len(tt.want) {
			t.Errorf("%s: problems %v, want %v", tt.name, ie.Problems, tt.want)
			continue
		}
		for i, p := range tt.want {
			if ie.Problems[i] != p {
				t.Errorf("%s: problem %d is %v, want %v", tt.name, i, ie.Problems[i], p)
			}
		}
		if strings.Contains(err.Error(), "\n") || !strings.HasPrefix(err.Error(), tt.want[0].Field+": ") {
			t.Errorf("%s: error text %q", tt.name, err)
		}
	}
}

// TestKindStrings: every kind has its own name, and Invalid is not
// among Kinds.
func TestKindStrings(t *testing.T) {
	seen := map[string]Kind{}
	for _, k := range Kinds() {
		s := k.String()
		if k == Invalid || strings.HasPrefix(s, "Kind(") {
			t.Errorf("kind %d: %q", k, s)
		}
		if o, dup := seen[s]; dup {
			t.Errorf("kinds %d and %d are both %q", o, k, s)
		}
		seen[s] = k
	}
	if s := Kind(200).String(); s != "Kind(200)" {
		t.Errorf("unknown kind: %q", s)
	}
}

func TestName(t *testing.T) {
	tests := []struct {
		route *tunnelpb.Route
		want  string
	}{
		{&tunnelpb.Route{Name: "n", Host: "a.test"}, "n"},
		{&tunnelpb.Route{Host: "a.test", HostPattern: "p"}, "a.test"},
		{&tunnelpb.Route{HostPattern: "p", ListenPort: 1}, "p"},
		{&tunnelpb.Route{ListenPort: 2222}, ":2222"},
		{&tunnelpb.Route{Target: "tcp://x:1"}, "*"},
	}
	for _, tt := range tests {
		if got := Name(tt.route); got != tt.want {
			t.Errorf("Name(%v) = %q, want %q", tt.route, got, tt.want)
		}
	}
}

// TestDatagram: the udp:// kinds, and only they, carry datagram flows.
func TestDatagram(t *testing.T) {
	for _, k := range append(Kinds(), Invalid) {
		if want := k == NamedUDP || k == UDPListenPort; k.Datagram() != want {
			t.Errorf("%v.Datagram() = %v", k, k.Datagram())
		}
	}
}

func TestTakesHTTP(t *testing.T) {
	want := map[Kind]bool{Host: true, HostPattern: true, CatchAll: true, TCPHost: true, TCPHostPattern: true}
	for _, k := range append(Kinds(), Invalid) {
		if k.TakesHTTP() != want[k] {
			t.Errorf("%v.TakesHTTP() = %v", k, k.TakesHTTP())
		}
	}
}

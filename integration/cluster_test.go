package integration

import (
	"bytes"
	"crypto/sha256"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

// The cluster (issue 24), proven with the real binaries: Caddy nodes as
// separate processes, each with its own admin API, ports and storage, and
// sluice-agent processes that learn the members from the node they were
// pointed at and keep a session with each.

// TestClusterMembership: three nodes list each other; two agents pointed
// at n1 alone (one through its member URL, one through another name) end
// with a session to each of the three, and each node
// serves both agents' hosts. A fourth node started and added by `caddy
// reload` on the three is joined by both agents without a restart; a
// reload that removes it again makes them leave it, and it is left with
// no session. The agents' sessions with n1..n3 live through both reloads.
func TestClusterMembership(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	nodes := newClusterNodes(t, caddyBin, 4, nodeSpec{})
	three, n4 := nodes[:3], nodes[3]
	startNodes(t, three, three)

	upA, upB := startUpstream(t, "app-a"), startUpstream(t, "app-b")
	a := startClusterAgent(t, agentBin, "agent-a", "-server", three[0].url(), "-upstream", "a.test="+upA)
	// agent-b bootstraps through another name of n1 (as through a load
	// balancer's): once told n1's URL, its link to n1 dials that, and it
	// keeps one session per node all the same.
	b := startClusterAgent(t, agentBin, "agent-b", "-server", strings.Replace(three[0].url(), "127.0.0.1", "localhost", 1),
		"-upstream", "b.test="+upB)
	agents := []*clusterAgent{a, b}
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, three...)
	}
	for _, n := range three {
		waitServes(t, n, "a.test", "Hello from app-a")
		waitServes(t, n, "b.test", "Hello from app-b")
		waitSessions(t, n, "agent-a", "agent-b")
	}
	for _, ag := range agents {
		// Each link dials its member's URL, the bootstrap one included
		// once the membership named the node it reached.
		st, err := ag.status()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st.Sessions {
			n := nodeByID(three, s.NodeID)
			if n == nil || s.URL != n.url() {
				t.Errorf("agent %s: session with %q dials %s (origin %s), want its member URL", ag.id, s.NodeID, s.URL, s.Origin)
			}
		}
		// /readyz: ready, a line per node.
		code, body, err := ag.adminGet("/readyz")
		if err != nil || code != 200 {
			t.Fatalf("agent %s /readyz: %d %s %v", ag.id, code, body, err)
		}
		for _, n := range three {
			if !strings.Contains(string(body), "node "+n.id+" "+n.url()+" connected") {
				t.Errorf("agent %s /readyz does not list %s connected:\n%s", ag.id, n.id, body)
			}
		}
	}

	// n4 joins: started knowing all four, then the three are reloaded.
	n4.start(nodes)
	reloadAll(t, three, nodes)
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, nodes...)
	}
	waitServes(t, n4, "a.test", "Hello from app-a")
	waitServes(t, n4, "b.test", "Hello from app-b")
	waitSessions(t, n4, "agent-a", "agent-b")

	// n4 leaves: every node, n4 included, is reloaded with n1..n3 (n4
	// remains a member of its own config, as the local node always is,
	// but the others no longer name it).
	reloadAll(t, three, three)
	n4.reload(three)
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, three...)
	}
	eventually(t, 20*time.Second, "n4 with no session", func() bool {
		st, err := n4.status()
		return err == nil && len(st.Sessions) == 0
	})
	for _, n := range three {
		waitServes(t, n, "a.test", "Hello from app-a")
		waitServes(t, n, "b.test", "Hello from app-b")
	}
	// Without a restart: the same processes, and their sessions with
	// n1..n3 are the first ones (a change of members opens and closes
	// the links it concerns, not the others).
	for _, ag := range agents {
		if ag.exited() {
			t.Fatalf("agent %s exited", ag.id)
		}
		st, err := ag.status()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st.Sessions {
			if s.Established != 1 {
				t.Errorf("agent %s: session with %s (%s) established %d times, want once", ag.id, s.NodeID, s.Server, s.Established)
			}
		}
	}
}

// TestClusterFailoverUnderLoad: haproxy balances the three nodes' HTTP
// ports, checking `sluice_health ready` every 200 ms. Under wrk's load, one
// node is stopped with `caddy stop` while a slow download runs through
// it, and later started again. No request fails; the download finishes
// intact within drain_grace; haproxy sends the restarted node nothing
// until its warm-up has passed.
func TestClusterFailoverUnderLoad(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	wrk := needCommand(t, "wrk")
	haproxyBinary(t)
	agentBin := buildAgent(t)
	const warmup, drainGrace, shutdownDelay = 3 * time.Second, 10 * time.Second, 2 * time.Second
	nodes := newClusterNodes(t, caddyBin, 3, nodeSpec{
		Warmup: warmup, DrainGrace: drainGrace, ShutdownDelay: shutdownDelay, GracePeriod: drainGrace,
	})
	startNodes(t, nodes, nodes)
	agents := startAppAgents(t, agentBin, nodes)
	for _, n := range nodes {
		n.waitReady(20 * time.Second)
	}
	lb := startHAProxy(t, nodes)
	victim := nodes[0]

	res, report := runFailover(t, failoverRun{
		wrk: wrk, lb: lb, victim: victim, agents: agents, duration: 18 * time.Second,
		warmup: warmup, drainGrace: drainGrace, shutdownDelay: shutdownDelay,
	})
	t.Logf("wrk through haproxy: %d requests, %d failed (non-2xx %d; socket errors connect %d, read %d, write %d, timeout %d)",
		res.requests, res.failed(), res.non2xx, res.connectErr, res.readErr, res.writeErr, res.timeoutErr)
	t.Log(report)
	if res.failed() != 0 {
		t.Errorf("%d of %d requests failed through haproxy while %s stopped and restarted:\n%s", res.failed(), res.requests, victim.id, res.out)
	}
	if res.requests < 1000 {
		t.Errorf("only %d requests in the run", res.requests)
	}
	// Both agents are back with every node.
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, nodes...)
	}
}

// startAppAgents starts agent-a and agent-b, both serving app.test (the
// sample application, with /slow) from upstreams of their own, pointed
// at nodes[0]; it waits for their sessions with every node.
func startAppAgents(t *testing.T, agentBin string, nodes []*clusterNode, extra ...string) []*clusterAgent {
	t.Helper()
	var agents []*clusterAgent
	for _, id := range []string{"agent-a", "agent-b"} {
		args := append([]string{"-server", nodes[0].url(), "-upstream", "app.test=" + slowUpstream(t, id)}, extra...)
		agents = append(agents, startClusterAgent(t, agentBin, id, args...))
	}
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, nodes...)
	}
	for _, n := range nodes {
		waitServes(t, n, "app.test", "Hello from agent-")
	}
	return agents
}

// failoverRun is one run of load through haproxy while victim stops
// (with a slow download through it) and starts again.
type failoverRun struct {
	wrk      string
	lb       *haproxyLB
	victim   *clusterNode
	agents   []*clusterAgent
	duration time.Duration
	// The victim's settings.
	warmup, drainGrace, shutdownDelay time.Duration
}

// runFailover runs wrk through haproxy for r.duration; meanwhile it starts
// a slow download through the victim's HTTP port, stops the victim with
// `caddy stop`, checks the download, starts the victim again and watches
// haproxy send it nothing during its warm-up. It returns wrk's result and
// a report of the figures.
func runFailover(t *testing.T, r failoverRun) (wrkResult, string) {
	t.Helper()
	before, err := r.lb.stats()
	if err != nil {
		t.Fatal(err)
	}
	wrkCmd := exec.Command(r.wrk, "-t1", "-c4", "-d"+strconv.Itoa(int(r.duration/time.Second))+"s", "--timeout", "5s",
		"-H", "Host: app.test", r.lb.url("/"))
	var wrkOut bytes.Buffer
	wrkCmd.Stdout, wrkCmd.Stderr = &wrkOut, &wrkOut
	wrkStart := time.Now()
	if err := wrkCmd.Start(); err != nil {
		t.Fatal(err)
	}
	var wrkErr error
	wrkDone := make(chan struct{})
	go func() { wrkErr = wrkCmd.Wait(); close(wrkDone) }()
	t.Cleanup(func() {
		select {
		case <-wrkDone:
		default:
			wrkCmd.Process.Kill()
			<-wrkDone
		}
	})
	// Load reaches every node before the stop.
	eventually(t, 10*time.Second, "load through haproxy on every node", func() bool {
		st, err := r.lb.stats()
		if err != nil {
			return false
		}
		for name := range st {
			if name != "BACKEND" && statInt(st, name, "stot") <= statInt(before, name, "stot")+50 {
				return false
			}
		}
		return true
	})

	// A slow download through the victim: 2 MiB, 128 KiB every 250 ms
	// (about 4 s), under way when the victim is told to stop.
	const size, chunk = 2 << 20, 128 << 10
	dl := startSlowDownload(t, r.victim, size, chunk, 250*time.Millisecond)
	stopAt := time.Now()
	stopped := r.victim.stop()
	// haproxy takes it out while it still accepts: within its
	// shutdown_delay, `sluice_health ready` answers 503 (the check's
	// status says so: a layer 7 answer, not a refused connection).
	var downCheck string
	eventually(t, r.shutdownDelay, "haproxy marking "+r.victim.id+" down within its shutdown_delay", func() bool {
		st, err := r.lb.stats()
		if err != nil || st[r.victim.id]["status"] == "UP" {
			return false
		}
		downCheck = st[r.victim.id]["check_status"] + " " + st[r.victim.id]["check_code"]
		return true
	})
	markedDown := time.Since(stopAt)
	if downCheck != "L7STS 503" {
		t.Errorf("haproxy marked %s down on check %q; want L7STS 503, the readiness answer of a node still accepting", r.victim.id, downCheck)
	}
	dlErr := dl.wait(r.drainGrace + 5*time.Second)
	dlTook := time.Since(stopAt)
	if dlErr != nil {
		t.Errorf("the slow download through %s, stopped %v into it: %v", r.victim.id, dl.startedAgo(stopAt), dlErr)
	} else if dlTook > r.drainGrace {
		t.Errorf("the slow download finished %v after the stop, beyond drain_grace %v", dlTook, r.drainGrace)
	}
	r.victim.waitExit(r.drainGrace + 10*time.Second)
	exitedAfter := time.Since(stopAt)
	stopped()
	down, err := r.lb.stats()
	if err != nil {
		t.Fatal(err)
	}
	if s := down[r.victim.id]["status"]; s == "UP" {
		t.Errorf("haproxy has %s %s after it exited", r.victim.id, s)
	}
	// The agents stay ready with the other nodes.
	for _, ag := range r.agents {
		if code, body, err := ag.adminGet("/readyz"); err != nil || code != 200 {
			t.Errorf("agent %s /readyz with %s gone: %d %s %v", ag.id, r.victim.id, code, body, err)
		}
	}

	// Restart: nothing reaches it during its warm-up.
	stotAtRestart := statInt(down, r.victim.id, "stot")
	r.victim.run()
	started := r.victim.running().started
	// Its own word: not ready, warming up (asked within the warm-up,
	// counted from the process's start, before its control plane's).
	// The admin API answers as soon as the process listens, possibly
	// before the config with the sluice app is loaded ("no sluice node in
	// the running config"): ask again until the node answers for itself.
	var code int
	var body []byte
	eventually(t, r.warmup, "the restarted node's own readiness answer", func() bool {
		var err error
		code, body, err = r.victim.adminGet("/sluice/ready")
		return err == nil && !strings.Contains(string(body), "no sluice node")
	})
	if time.Since(started) < r.warmup && (code != http.StatusServiceUnavailable || !strings.Contains(string(body), "warming up")) {
		t.Errorf("%s's /sluice/ready within its warm-up: %d %s", r.victim.id, code, body)
	}
	type sample struct {
		at     time.Duration
		status string
		stot   int64
	}
	var samples []sample
	var sessionsAtUp []string
	eventually(t, 30*time.Second, r.victim.id+" back in haproxy with traffic", func() bool {
		st, err := r.lb.stats()
		if err != nil {
			return false
		}
		select {
		case <-wrkDone:
			t.Fatalf("the load run ended before %s was back with traffic:\n%s", r.victim.id, wrkOut.String())
		default:
		}
		s := sample{at: time.Since(started), status: st[r.victim.id]["status"], stot: statInt(st, r.victim.id, "stot")}
		samples = append(samples, s)
		if s.status == "UP" && sessionsAtUp == nil {
			sessionsAtUp, _ = r.victim.sessionIDs()
		}
		return s.status == "UP" && s.stot > stotAtRestart+50
	})
	var firstUp, firstTraffic time.Duration = -1, -1
	inWarmup := 0
	for _, s := range samples {
		if s.at < r.warmup {
			inWarmup++
		}
		if s.status == "UP" && firstUp < 0 {
			firstUp = s.at
		}
		if s.stot > stotAtRestart && firstTraffic < 0 {
			firstTraffic = s.at
		}
		if s.at < r.warmup && (s.status == "UP" || s.stot > stotAtRestart) {
			t.Errorf("%v after its restart, within its warm-up of %v, haproxy has %s %s with %d requests sent to it (%d at the restart)",
				s.at, r.warmup, r.victim.id, s.status, s.stot, stotAtRestart)
		}
	}
	if inWarmup < 10 {
		t.Errorf("only %d looks at haproxy's stats during %s's warm-up", inWarmup, r.victim.id)
	}
	backAt := time.Since(wrkStart)

	select {
	case <-wrkDone:
		if wrkErr != nil {
			t.Fatalf("wrk: %v\n%s", wrkErr, wrkOut.String())
		}
	case <-time.After(r.duration + 30*time.Second):
		t.Fatal("wrk did not end")
	}
	res, err := parseWrk(wrkOut.String())
	if err != nil {
		t.Fatal(err)
	}
	after, err := r.lb.stats()
	if err != nil {
		t.Fatal(err)
	}
	var rep strings.Builder
	fmt.Fprintf(&rep, "%s marked down by haproxy (check %s) %v after `caddy stop` (shutdown_delay %v); slow download: %d bytes intact, finished %v after the stop; %s exited %v after it\n",
		r.victim.id, downCheck, markedDown.Round(time.Millisecond), r.shutdownDelay, size, dlTook.Round(time.Millisecond), r.victim.id, exitedAfter.Round(time.Millisecond))
	fmt.Fprintf(&rep, "%s restarted: first UP in haproxy %v after the start (warm-up %v), first request sent %v after it; sessions then: %v\n",
		r.victim.id, firstUp.Round(time.Millisecond), r.warmup, firstTraffic.Round(time.Millisecond), sessionsAtUp)
	fmt.Fprintf(&rep, "%s back with traffic %v into the %v load run\n", r.victim.id, backAt.Round(time.Millisecond), r.duration)
	names := make([]string, 0, len(after))
	for name := range after {
		names = append(names, name)
	}
	slices.Sort(names)
	for _, name := range names {
		d := func(f string) int64 { return statInt(after, name, f) - statInt(before, name, f) }
		fmt.Fprintf(&rep, "haproxy %s: %d requests, 2xx %d, 5xx %d, connection errors %d, response errors %d, retries %d, redispatches %d\n",
			name, d("stot"), d("hrsp_2xx"), d("hrsp_5xx"), d("econ"), d("eresp"), d("wretr"), d("wredis"))
	}
	if n := statInt(after, "BACKEND", "hrsp_5xx") - statInt(before, "BACKEND", "hrsp_5xx"); n != 0 {
		t.Errorf("haproxy answered %d requests with 5xx", n)
	}
	// Nothing was retried either: haproxy never sent a request to a node
	// that refused or dropped it (its retries would hide that from wrk).
	for _, name := range names {
		for _, f := range []string{"econ", "eresp", "wretr", "wredis"} {
			if n := statInt(after, name, f) - statInt(before, name, f); n != 0 {
				t.Errorf("haproxy %s: %s %d", name, f, n)
			}
		}
	}
	return res, rep.String()
}

// slowDownload is a /slow download through a node, read in the background.
type slowDownload struct {
	start time.Time
	done  chan error
}

// startSlowDownload GETs /slow through n's HTTP port and returns once the
// first chunk arrived; the rest is read and checked in the background.
func startSlowDownload(t *testing.T, n *clusterNode, size, chunk int64, every time.Duration) *slowDownload {
	t.Helper()
	req, _ := http.NewRequest("GET", fmt.Sprintf("http://%s/slow?size=%d&chunk=%d&every=%s", n.httpAddr(), size, chunk, every), nil)
	req.Host = "app.test"
	client := &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableCompression: true}}
	d := &slowDownload{start: time.Now(), done: make(chan error, 1)}
	resp, err := client.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { resp.Body.Close() })
	if resp.StatusCode != 200 {
		t.Fatalf("slow download through %s: status %d", n.id, resp.StatusCode)
	}
	h := sha256.New()
	if _, err := io.CopyN(h, resp.Body, chunk); err != nil {
		t.Fatalf("slow download through %s: first chunk: %v", n.id, err)
	}
	go func() {
		got, err := io.Copy(h, resp.Body)
		got += chunk
		if err == nil && got != size {
			err = fmt.Errorf("%d of %d bytes", got, size)
		}
		if err == nil {
			want := sha256.New()
			io.Copy(want, sampleupstream.Pattern(size))
			if !bytes.Equal(h.Sum(nil), want.Sum(nil)) {
				err = fmt.Errorf("the body differs from the upstream's")
			}
		}
		d.done <- err
	}()
	return d
}

// wait waits (bounded) for the download's end and returns its error.
func (d *slowDownload) wait(within time.Duration) error {
	select {
	case err := <-d.done:
		return err
	case <-time.After(within):
		return fmt.Errorf("not finished %v later", within)
	}
}

func (d *slowDownload) startedAgo(at time.Time) time.Duration {
	return at.Sub(d.start).Round(time.Millisecond)
}

// TestClusterPortClaims: a listen-port route is bound on every node of a
// cluster (the same port, each node's tcp_bind on its own loopback
// address). With two agents claiming it, every node gives it to the
// smaller agent id, whichever connected first.
func TestClusterPortClaims(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	ips := []string{"127.0.0.1", "127.0.0.2", "127.0.0.3"}
	port := freePortOn(t, ips...)
	var nodes []*clusterNode
	for i, ip := range ips {
		nodes = append(nodes, newClusterNode(t, caddyBin, fmt.Sprintf("n%d", i+1), ip, nodeSpec{
			Sluice: fmt.Sprintf("\t\ttcp_port_range %d-%d\n\t\ttcp_bind %s", port, port, ip),
		}))
	}
	startNodes(t, nodes, nodes)
	targets := map[string]string{"agent-a": tcpGreeter(t, "upstream-a"), "agent-b": tcpGreeter(t, "upstream-b")}

	for _, order := range [][]string{{"agent-a", "agent-b"}, {"agent-b", "agent-a"}} {
		t.Run(order[0]+" first", func(t *testing.T) {
			var started []*clusterAgent
			for _, id := range order {
				ag := startClusterAgent(t, agentBin, id, "-server", nodes[0].url(),
					"-upstream", fmt.Sprintf("name=port,listen_port=%d,target=%s", port, targets[id]))
				ag.waitConnectedTo(t, 20*time.Second, nodes...)
				started = append(started, ag)
				if id == order[0] {
					// The first holds the port on every node before the
					// second comes.
					for _, n := range nodes {
						waitGreeting(t, n, port, "upstream-"+strings.TrimPrefix(id, "agent-"))
					}
				}
			}
			for _, n := range nodes {
				waitPortOwner(t, n, port, "agent-a")
				waitGreeting(t, n, port, "upstream-a")
			}
			// Both leave: the next order starts from free ports.
			for _, ag := range started {
				ag.cmd.Process.Kill()
				<-ag.done
			}
			for _, n := range nodes {
				waitSessions(t, n)
			}
		})
	}
}

// waitPortOwner waits (bounded) until n's /sluice/status names owner as the
// agent owning port.
func waitPortOwner(t *testing.T, n *clusterNode, port int, owner string) {
	t.Helper()
	var got string
	eventually(t, 20*time.Second, fmt.Sprintf("%s's port %d owned by %s", n.id, port, owner), func() bool {
		st, err := n.status()
		if err != nil {
			return false
		}
		for _, p := range st.Ports {
			if int(p.Port) == port {
				got = p.Owner
			}
		}
		return got == owner
	})
}

// waitGreeting waits (bounded) until a connection to n's port is greeted
// with want.
func waitGreeting(t *testing.T, n *clusterNode, port int, want string) {
	t.Helper()
	addr := net.JoinHostPort(n.ip, strconv.Itoa(port))
	var got string
	var err error
	eventually(t, 20*time.Second, fmt.Sprintf("%s greeted by %s", addr, want), func() bool {
		got, err = greeting(addr)
		return err == nil && got == want
	})
}

// TestClusterTLS: the membership and failover scenario, shorter, with the
// control plane of every node on TLS (`tls <cert> <key>` of a test CA):
// agents pointed at n1 over grpcs:// with the CA as ca_file hold sessions
// with all three; under load through haproxy n2 stops and starts again
// with no failed request, and both agents are back with it.
func TestClusterTLS(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	wrk := needCommand(t, "wrk")
	haproxyBinary(t)
	agentBin := buildAgent(t)
	ca := newTestCA(t)
	const warmup, drainGrace, shutdownDelay = 2 * time.Second, 8 * time.Second, 2 * time.Second
	nodes := newClusterNodes(t, caddyBin, 3, nodeSpec{
		TLS: ca, Warmup: warmup, DrainGrace: drainGrace, ShutdownDelay: shutdownDelay, GracePeriod: drainGrace,
	})
	startNodes(t, nodes, nodes)
	for _, n := range nodes {
		if !strings.HasPrefix(n.url(), "grpcs://") {
			t.Fatalf("%s: %s", n.id, n.url())
		}
	}
	agents := startAppAgents(t, agentBin, nodes, "-ca-file", ca.caFile)
	for _, ag := range agents {
		st, err := ag.status()
		if err != nil {
			t.Fatal(err)
		}
		for _, s := range st.Sessions {
			if !strings.HasPrefix(s.Server, "grpcs://") {
				t.Errorf("agent %s: session with %s on %s, want grpcs://", ag.id, s.NodeID, s.Server)
			}
		}
	}
	for _, n := range nodes {
		n.waitReady(20 * time.Second)
	}
	lb := startHAProxy(t, nodes)
	res, report := runFailover(t, failoverRun{
		wrk: wrk, lb: lb, victim: nodes[1], agents: agents, duration: 12 * time.Second,
		warmup: warmup, drainGrace: drainGrace, shutdownDelay: shutdownDelay,
	})
	t.Logf("wrk through haproxy (TLS control plane): %d requests, %d failed", res.requests, res.failed())
	t.Log(report)
	if res.failed() != 0 {
		t.Errorf("%d of %d requests failed:\n%s", res.failed(), res.requests, res.out)
	}
	for _, ag := range agents {
		ag.waitConnectedTo(t, 20*time.Second, nodes...)
	}
}

// TestClusterDNSMembership: the agent's server is a host name with two
// addresses (127.0.0.1 and 127.0.0.2, a node listening on the same port at
// each); with server_each_address it keeps a session with each. The name
// resolves through a private /etc/hosts: the agent runs in a mount
// namespace of its own where a temporary file is bind-mounted over it.
func TestClusterDNSMembership(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	ips := []string{"127.0.0.1", "127.0.0.2"}
	control := freePortOn(t, ips...)
	var nodes []*clusterNode
	for i, ip := range ips {
		n := newClusterNode(t, caddyBin, fmt.Sprintf("n%d", i+1), ip, nodeSpec{NoCluster: true})
		n.control = control
		nodes = append(nodes, n)
	}
	startNodes(t, nodes, nil)
	hosts := filepath.Join(t.TempDir(), "hosts")
	if err := os.WriteFile(hosts, []byte("127.0.0.1 localhost\n127.0.0.1 nodes.sluice.test\n127.0.0.2 nodes.sluice.test\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	up := startUpstream(t, "dns-app")
	ag := startUnsharedAgent(t, agentBin, hosts, "agent-dns", "-server", fmt.Sprintf("grpc://nodes.sluice.test:%d", control),
		"-server-each-address", "-server-refresh", "1s", "-upstream", "app.test="+up)
	// One session per address: the link dials the address, and the node
	// it reached is the one listening there.
	waitAddressSessions := func(want ...*clusterNode) {
		t.Helper()
		from := time.Now()
		var got []string
		eventually(t, 20*time.Second, fmt.Sprintf("the agent connected to exactly %v", nodeIDs(want)), func() bool {
			if ag.exited() {
				t.Fatalf("agent exited:\n%s", ag.out.String())
			}
			st, err := ag.status()
			if err != nil {
				return false
			}
			got = got[:0]
			connected := 0
			for _, s := range st.Sessions {
				got = append(got, fmt.Sprintf("%s %s (origin %s, node %s)", s.URL, s.State, s.Origin, s.NodeID))
				for _, n := range want {
					if s.State == "connected" && s.Origin == "dns" && s.URL == n.url() && strings.HasPrefix(listenerOf(s.NodeID), n.ip+":") {
						connected++
					}
				}
			}
			return connected == len(want) && len(st.Sessions) == len(want)
		})
		t.Logf("agent sessions %v later: %v", time.Since(from).Round(time.Millisecond), got)
	}
	waitAddressSessions(nodes...)
	for _, n := range nodes {
		waitSessions(t, n, "agent-dns")
		waitServes(t, n, "app.test", "Hello from dns-app")
	}

	// The name is resolved again every server_refresh (1 s here): an
	// address gone from it is left, one back is joined again. (Go's
	// resolver reads /etc/hosts again at most every 5 s: each step takes
	// that long.)
	writeHosts := func(ips ...string) {
		text := "127.0.0.1 localhost\n"
		for _, ip := range ips {
			text += ip + " nodes.sluice.test\n"
		}
		// In place: the bind mount shows the file's inode.
		if err := os.WriteFile(hosts, []byte(text), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	writeHosts("127.0.0.1")
	waitAddressSessions(nodes[0])
	waitSessions(t, nodes[1])
	writeHosts(ips...)
	waitAddressSessions(nodes...)
	waitSessions(t, nodes[1], "agent-dns")
}

// TestClusterSharedCertificates: two nodes with the same storage and a
// `tls internal` HTTPS site for a tunneled host. The certificate the
// first node obtained is the one the second serves (same serial): Caddy's
// storage is how the nodes of a cluster share certificates.
func TestClusterSharedCertificates(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	storage := t.TempDir()
	const sites = `https://app.test:{HTTPS} {
	tls internal
	sluice
}`
	nodes := newClusterNodes(t, caddyBin, 2, nodeSpec{Storage: storage, Sites: sites})
	n1, n2 := nodes[0], nodes[1]
	n1.start(nodes)
	var serial1 string
	eventually(t, 20*time.Second, "n1 serving its certificate for app.test", func() bool {
		var err error
		serial1, err = tlsSerial(n1.httpsAddr(), "app.test")
		return err == nil
	})
	n2.start(nodes)
	var serial2 string
	eventually(t, 20*time.Second, "n2 serving a certificate for app.test", func() bool {
		var err error
		serial2, err = tlsSerial(n2.httpsAddr(), "app.test")
		return err == nil
	})
	if serial1 != serial2 {
		t.Fatalf("n1 serves serial %s, n2 serial %s: the second node did not take the certificate from the shared storage", serial1, serial2)
	}
	t.Logf("both nodes serve the certificate with serial %s", serial1)

	up := startUpstream(t, "cert-app")
	ag := startClusterAgent(t, agentBin, "agent-cert", "-server", n1.url(), "-upstream", "app.test="+up)
	ag.waitConnectedTo(t, 20*time.Second, nodes...)
	for _, n := range nodes {
		var code int
		var body string
		var err error
		eventually(t, 20*time.Second, "app.test over HTTPS through "+n.id, func() bool {
			code, body, err = httpsGetVia(n.httpsAddr(), "app.test")
			return err == nil && code == 200 && strings.Contains(body, "Hello from cert-app")
		})
	}
}

// TestClusterAgentCost reports what each node of a cluster costs an idle
// agent: its goroutines and resident memory with 1, 3 and 5 members, one
// agent process whose cluster grows by reloads. Figures only: no
// assertion on them.
func TestClusterAgentCost(t *testing.T) {
	t.Parallel()
	caddyBin := caddyBinary(t)
	agentBin := buildAgent(t)
	nodes := newClusterNodes(t, caddyBin, 5, nodeSpec{})
	startNodes(t, nodes[:1], nodes[:1])
	up := startUpstream(t, "cost-app")
	ag := startClusterAgent(t, agentBin, "agent-cost", "-server", nodes[0].url(), "-upstream", "app.test="+up)
	var lines []string
	type cost struct{ goroutines, rss, heap float64 }
	costs := map[int]cost{}
	measure := func(members int) {
		ag.waitConnectedTo(t, 20*time.Second, nodes[:members]...)
		// A request through every node: each session has carried one.
		for _, n := range nodes[:members] {
			waitServes(t, n, "app.test", "Hello from cost-app")
		}
		m, err := ag.metrics()
		if err != nil {
			t.Fatal(err)
		}
		rss := pidRSS(t, ag.cmd.Process.Pid)
		costs[members] = cost{m["go_goroutines"], m["process_resident_memory_bytes"], m["go_memstats_heap_inuse_bytes"]}
		lines = append(lines, fmt.Sprintf("%d node(s): %3.0f goroutines, RSS %5.1f MiB (VmRSS %5.1f MiB), heap in use %5.1f MiB",
			members, m["go_goroutines"], m["process_resident_memory_bytes"]/(1<<20), float64(rss)/(1<<20),
			m["go_memstats_heap_inuse_bytes"]/(1<<20)))
	}
	measure(1)
	prev := 1
	for _, step := range []int{3, 5} {
		startNodes(t, nodes[prev:step], nodes[:step])
		reloadAll(t, nodes[:prev], nodes[:step])
		measure(step)
		prev = step
	}
	for _, l := range lines {
		t.Log("agent cost with " + l)
	}
	one, five := costs[1], costs[5]
	t.Logf("agent cost per node beyond the first: %.0f goroutines, RSS %.2f MiB, heap in use %.2f MiB",
		(five.goroutines-one.goroutines)/4, (five.rss-one.rss)/4/(1<<20), (five.heap-one.heap)/4/(1<<20))
}

// nodeByID is the node of nodes with id, nil if none.
func nodeByID(nodes []*clusterNode, id string) *clusterNode {
	for _, n := range nodes {
		if n.id == id {
			return n
		}
	}
	return nil
}

// waitServes waits (bounded) for host through n to answer 200 with a body
// containing want.
func waitServes(t *testing.T, n *clusterNode, host, want string) {
	t.Helper()
	var code int
	var body string
	eventually(t, 20*time.Second, fmt.Sprintf("%s through %s", host, n.id), func() bool {
		code, body = n.get(host, "/")
		return code == 200 && strings.Contains(body, want)
	})
}

// waitSessions waits (bounded) until n's sessions are exactly those of ids.
func waitSessions(t *testing.T, n *clusterNode, ids ...string) {
	t.Helper()
	want := slices.Clone(ids)
	slices.Sort(want)
	var got []string
	eventually(t, 20*time.Second, fmt.Sprintf("%s with sessions of exactly %v", n.id, want), func() bool {
		var err error
		got, err = n.sessionIDs()
		return err == nil && slices.Equal(got, want)
	})
}

// listenerOf is the listener address in a standalone node's id
// ("node_id@address"; the address alone from older nodes).
func listenerOf(nodeID string) string {
	if _, addr, ok := strings.Cut(nodeID, "@"); ok {
		return addr
	}
	return nodeID
}

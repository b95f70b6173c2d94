package integration

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/csv"
	"encoding/json"
	"encoding/pem"
	"errors"
	"fmt"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/sampleupstream"
)

// The helpers of the cluster tests (cluster_test.go): Caddy binaries as
// cluster nodes, each with its own admin address, ports and directories;
// sluice-agent binaries with their admin listener; haproxy in front; a
// test CA for the control plane's TLS.

// clusterToken is the token every node of a test cluster shares: cluster
// mode wants an explicit credential.
const clusterToken = "cluster-test-token-0123456789abcdef"

// clusterNode is one Caddy binary of a test cluster. Its listeners bind
// ip (127.0.0.x); its admin API listens on 127.0.0.1, so `caddy stop` and
// `caddy reload` reach it with --address.
type clusterNode struct {
	t   *testing.T
	bin string
	id  string
	ip  string
	// ports: admin (127.0.0.1), the sites' HTTP and HTTPS, the control
	// plane.
	admin, http, https, control int
	// dir holds the Caddyfile and the process's HOME and XDG directories.
	dir, caddyfile string
	spec           nodeSpec

	mu   sync.Mutex
	proc *caddyProc // the running process, nil before start
	runs []*caddyProc
}

// nodeSpec is what a node's Caddyfile says besides its addresses.
type nodeSpec struct {
	// TLS, when set, serves the control plane with the CA's node
	// certificate: members' URLs are grpcs://.
	TLS *testCA
	// Warmup, DrainGrace: the sluice block's; zero leaves them out.
	Warmup, DrainGrace time.Duration
	// ShutdownDelay, GracePeriod: Caddy's global options; zero leaves
	// them out.
	ShutdownDelay, GracePeriod time.Duration
	// Storage is the storage directory; default one of the node's own.
	Storage string
	// Sluice is extra lines of the sluice block.
	Sluice string
	// Sites is the site blocks, {HTTP} and {HTTPS} standing for the
	// node's ports; default siteWithHealth.
	Sites string
	// NoCluster leaves the cluster block out (a node on its own).
	NoCluster bool
}

// siteWithHealth serves the node's readiness on /ready (for haproxy's
// check) and everything else through the tunnel.
const siteWithHealth = `http://:{HTTP} {
	handle /ready {
		sluice_health ready
	}
	handle {
		sluice
	}
}`

// caddyProc is one run of a node's process.
type caddyProc struct {
	cmd     *exec.Cmd
	out     *syncBuffer
	done    chan struct{}
	started time.Time
}

func (p *caddyProc) exited() bool {
	select {
	case <-p.done:
		return true
	default:
		return false
	}
}

// newClusterNodes makes n nodes n1..nN (not started) on 127.0.0.1, each
// with its own ports and directories.
func newClusterNodes(t *testing.T, bin string, n int, spec nodeSpec) []*clusterNode {
	t.Helper()
	nodes := make([]*clusterNode, n)
	for i := range nodes {
		nodes[i] = newClusterNode(t, bin, fmt.Sprintf("n%d", i+1), "127.0.0.1", spec)
	}
	return nodes
}

// newClusterNode makes a node (not started) whose listeners bind ip.
func newClusterNode(t *testing.T, bin, id, ip string, spec nodeSpec) *clusterNode {
	t.Helper()
	dir := t.TempDir()
	n := &clusterNode{t: t, bin: bin, id: id, ip: ip, admin: freePort(t), http: freePort(t), https: freePort(t),
		control: freePort(t), dir: dir, caddyfile: filepath.Join(dir, "Caddyfile"), spec: spec}
	t.Cleanup(n.kill)
	return n
}

// url is the control plane address agents dial: grpc:// or grpcs://.
func (n *clusterNode) url() string {
	scheme := "grpc"
	if n.spec.TLS != nil {
		scheme = "grpcs"
	}
	return fmt.Sprintf("%s://%s", scheme, net.JoinHostPort(n.ip, strconv.Itoa(n.control)))
}

func (n *clusterNode) adminAddr() string { return fmt.Sprintf("127.0.0.1:%d", n.admin) }

func (n *clusterNode) httpAddr() string { return net.JoinHostPort(n.ip, strconv.Itoa(n.http)) }

func (n *clusterNode) httpsAddr() string { return net.JoinHostPort(n.ip, strconv.Itoa(n.https)) }

// caddyfileText is the node's Caddyfile with members as its cluster.
func (n *clusterNode) caddyfileText(members []*clusterNode) string {
	s := n.spec
	var g strings.Builder
	fmt.Fprintf(&g, "{\n\tadmin %s\n\tpersist_config off\n\tskip_install_trust\n", n.adminAddr())
	storage := s.Storage
	if storage == "" {
		storage = filepath.Join(n.dir, "storage")
	}
	fmt.Fprintf(&g, "\tstorage file_system %s\n\thttp_port %d\n\thttps_port %d\n\tdefault_bind %s\n\tauto_https disable_redirects\n",
		storage, n.http, n.https, n.ip)
	if s.ShutdownDelay > 0 {
		fmt.Fprintf(&g, "\tshutdown_delay %s\n", s.ShutdownDelay)
	}
	if s.GracePeriod > 0 {
		fmt.Fprintf(&g, "\tgrace_period %s\n", s.GracePeriod)
	}
	fmt.Fprintf(&g, "\tsluice {\n\t\tlisten %s\n\t\ttoken %s\n\t\tnode_id %s\n",
		net.JoinHostPort(n.ip, strconv.Itoa(n.control)), clusterToken, n.id)
	if s.TLS != nil {
		fmt.Fprintf(&g, "\t\ttls %s %s\n", s.TLS.certFile, s.TLS.keyFile)
	}
	if s.Warmup > 0 {
		fmt.Fprintf(&g, "\t\twarmup %s\n", s.Warmup)
	}
	if s.DrainGrace > 0 {
		fmt.Fprintf(&g, "\t\tdrain_grace %s\n", s.DrainGrace)
	}
	if !s.NoCluster {
		g.WriteString("\t\tcluster {\n")
		for _, m := range members {
			fmt.Fprintf(&g, "\t\t\tnode %s %s\n", m.id, m.url())
		}
		g.WriteString("\t\t}\n")
	}
	if s.Sluice != "" {
		g.WriteString(s.Sluice + "\n")
	}
	g.WriteString("\t}\n}\n\n")
	sites := s.Sites
	if sites == "" {
		sites = siteWithHealth
	}
	g.WriteString(sites + "\n")
	return strings.NewReplacer("{HTTP}", strconv.Itoa(n.http), "{HTTPS}", strconv.Itoa(n.https)).Replace(g.String())
}

// write writes the node's Caddyfile with members as its cluster.
func (n *clusterNode) write(members []*clusterNode) {
	n.t.Helper()
	if err := os.WriteFile(n.caddyfile, []byte(n.caddyfileText(members)), 0o644); err != nil {
		n.t.Fatal(err)
	}
}

// env is the process environment of the node's Caddy: its own HOME and
// XDG directories (its data and config: the local CA, autosave), never
// the machine's.
func (n *clusterNode) env() []string {
	return append(os.Environ(), "HOME="+n.dir, "XDG_DATA_HOME="+filepath.Join(n.dir, "data"),
		"XDG_CONFIG_HOME="+filepath.Join(n.dir, "config"))
}

// start writes the Caddyfile with members and runs `caddy run`; it returns
// once the admin API answers (readiness may still be down: warmup).
func (n *clusterNode) start(members []*clusterNode) {
	n.t.Helper()
	n.write(members)
	n.run()
}

// run starts the process on the Caddyfile as written and waits for its
// admin API.
func (n *clusterNode) run() {
	n.t.Helper()
	n.runAsync()
	n.waitAdmin(20 * time.Second)
}

// running is the node's current process.
func (n *clusterNode) running() *caddyProc {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.proc
}

// kill ends every process of the node at once (cleanup), and shows the
// output of each when the test failed.
func (n *clusterNode) kill() {
	n.mu.Lock()
	runs := n.runs
	n.mu.Unlock()
	for i, p := range runs {
		if !p.exited() {
			p.cmd.Process.Kill()
			<-p.done
		}
		if n.t.Failed() {
			n.t.Logf("%s caddy (run %d) output:\n%s", n.id, i+1, p.out.String())
		}
	}
}

// stop starts `caddy stop --address` for the node's admin API and
// returns at once; the command returns once Caddy stopped its apps (after
// shutdown_delay and the draining), and its error, if any, fails the test
// when the returned function is called.
func (n *clusterNode) stop() (wait func()) {
	n.t.Helper()
	cmd := exec.Command(n.bin, "stop", "--address", n.adminAddr())
	cmd.Env = n.env()
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		n.t.Fatal(err)
	}
	var err error
	done := make(chan struct{})
	go func() { err = cmd.Wait(); close(done) }()
	n.t.Cleanup(func() {
		select {
		case <-done:
		default:
			cmd.Process.Kill()
			<-done
		}
	})
	return func() {
		n.t.Helper()
		select {
		case <-done:
		case <-time.After(30 * time.Second):
			n.t.Fatalf("caddy stop %s still running 30s later", n.id)
		}
		if err != nil {
			n.t.Fatalf("caddy stop %s: %v\n%s", n.id, err, out.String())
		}
	}
}

// waitExit waits (bounded) for the node's current process to exit.
func (n *clusterNode) waitExit(within time.Duration) {
	n.t.Helper()
	p := n.running()
	select {
	case <-p.done:
	case <-time.After(within):
		n.t.Fatalf("%s's caddy still running %v later", n.id, within)
	}
}

// reload rewrites the Caddyfile with members and runs `caddy reload`
// against the node's admin API.
func (n *clusterNode) reload(members []*clusterNode) {
	n.t.Helper()
	n.write(members)
	cmd := exec.Command(n.bin, "reload", "--config", n.caddyfile, "--adapter", "caddyfile", "--address", n.adminAddr())
	cmd.Env = n.env()
	if out, err := cmd.CombinedOutput(); err != nil {
		n.t.Fatalf("caddy reload %s: %v\n%s", n.id, err, out)
	}
}

// adminGet GETs path of the node's admin API.
func (n *clusterNode) adminGet(path string) (int, []byte, error) {
	req, _ := http.NewRequest("GET", "http://"+n.adminAddr()+path, nil)
	// Caddy's admin API checks the Host (and Origin) of each request.
	req.Host = n.adminAddr()
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Do(req)
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// status is the node's /sluice/status (its one node).
func (n *clusterNode) status() (caddymodule.NodeStatus, error) {
	code, b, err := n.adminGet("/sluice/status")
	if err != nil {
		return caddymodule.NodeStatus{}, err
	}
	if code != 200 {
		return caddymodule.NodeStatus{}, fmt.Errorf("%s /sluice/status: %d %s", n.id, code, b)
	}
	var st caddymodule.StatusResponse
	if err := json.Unmarshal(b, &st); err != nil {
		return caddymodule.NodeStatus{}, err
	}
	if len(st.Nodes) != 1 {
		return caddymodule.NodeStatus{}, fmt.Errorf("%s /sluice/status: %d nodes", n.id, len(st.Nodes))
	}
	return st.Nodes[0], nil
}

// sessionIDs are the agent ids of the node's sessions, sorted.
func (n *clusterNode) sessionIDs() ([]string, error) {
	st, err := n.status()
	if err != nil {
		return nil, err
	}
	ids := []string{}
	for _, s := range st.Sessions {
		ids = append(ids, s.AgentID)
	}
	slices.Sort(ids)
	return ids, nil
}

// ready reports the node's /sluice/ready.
func (n *clusterNode) ready() bool {
	code, _, err := n.adminGet("/sluice/ready")
	return err == nil && code == 200
}

// waitReady waits (bounded) for the node's readiness.
func (n *clusterNode) waitReady(within time.Duration) {
	n.t.Helper()
	eventually(n.t, within, n.id+" ready", n.ready)
}

// get GETs path of host through the node's HTTP port; code 0 and the
// error text when the request failed.
func (n *clusterNode) get(host, path string) (int, string) {
	req, _ := http.NewRequest("GET", "http://"+n.httpAddr()+path, nil)
	req.Host = host
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}}
	resp, err := client.Do(req)
	if err != nil {
		return 0, err.Error()
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}

// startNodes starts nodes in parallel, each with members as its cluster.
func startNodes(t *testing.T, nodes, members []*clusterNode) {
	t.Helper()
	for _, n := range nodes {
		n.write(members)
	}
	for _, n := range nodes {
		n.runAsync()
	}
	for _, n := range nodes {
		n.waitAdmin(20 * time.Second)
	}
}

// runAsync starts the process without waiting (startNodes waits for all).
func (n *clusterNode) runAsync() {
	p := &caddyProc{out: new(syncBuffer), done: make(chan struct{})}
	p.cmd = exec.Command(n.bin, "run", "--config", n.caddyfile, "--adapter", "caddyfile")
	p.cmd.Env = n.env()
	p.cmd.Stdout, p.cmd.Stderr = p.out, p.out
	p.started = time.Now()
	if err := p.cmd.Start(); err != nil {
		close(p.done)
		p.out.Write([]byte(err.Error()))
	} else {
		go func() { p.cmd.Wait(); close(p.done) }()
	}
	n.mu.Lock()
	n.proc = p
	n.runs = append(n.runs, p)
	n.mu.Unlock()
}

// waitAdmin waits (bounded) for the current process's admin API.
func (n *clusterNode) waitAdmin(within time.Duration) {
	n.t.Helper()
	p := n.running()
	eventually(n.t, within, n.id+"'s admin API answering", func() bool {
		if p.exited() {
			n.t.Fatalf("%s's caddy exited:\n%s", n.id, p.out.String())
		}
		code, _, err := n.adminGet("/sluice/status")
		return err == nil && code == 200
	})
}

// reloadAll reloads nodes with members as their cluster.
func reloadAll(t *testing.T, nodes, members []*clusterNode) {
	t.Helper()
	for _, n := range nodes {
		n.reload(members)
	}
}

// clusterAgent is a sluice-agent binary with its admin listener.
type clusterAgent struct {
	*agentProcess
	id    string
	admin int
}

// startClusterAgent runs the agent binary with id, the cluster token and
// an admin listener, then args (-server, -upstream ...).
func startClusterAgent(t *testing.T, bin, id string, args ...string) *clusterAgent {
	t.Helper()
	admin := freePort(t)
	all := append([]string{"-id", id, "-token", clusterToken, "-admin-listen", fmt.Sprintf("127.0.0.1:%d", admin)}, args...)
	return &clusterAgent{agentProcess: startAgentProcess(t, bin, all...), id: id, admin: admin}
}

// adminGet GETs path of the agent's admin listener.
func (a *clusterAgent) adminGet(path string) (int, []byte, error) {
	resp, err := (&http.Client{Timeout: 5 * time.Second}).Get(fmt.Sprintf("http://127.0.0.1:%d%s", a.admin, path))
	if err != nil {
		return 0, nil, err
	}
	defer resp.Body.Close()
	b, err := io.ReadAll(resp.Body)
	return resp.StatusCode, b, err
}

// status is the agent's /status.
func (a *clusterAgent) status() (agent.Status, error) {
	var st agent.Status
	code, b, err := a.adminGet("/status")
	if err != nil {
		return st, err
	}
	if code != 200 {
		return st, fmt.Errorf("agent %s /status: %d %s", a.id, code, b)
	}
	err = json.Unmarshal(b, &st)
	return st, err
}

// connectedNodes are the node ids of the agent's connected sessions,
// sorted, and the number of sessions (links) /status lists, connected or
// not.
func (a *clusterAgent) connectedNodes() ([]string, int, error) {
	st, err := a.status()
	if err != nil {
		return nil, 0, err
	}
	ids := []string{}
	for _, s := range st.Sessions {
		if s.State == "connected" {
			ids = append(ids, s.NodeID)
		}
	}
	slices.Sort(ids)
	return ids, len(st.Sessions), nil
}

// waitConnectedTo waits (bounded) until the agent's sessions are exactly
// those to nodes, all connected.
func (a *clusterAgent) waitConnectedTo(t *testing.T, within time.Duration, nodes ...*clusterNode) {
	t.Helper()
	want := nodeIDs(nodes)
	var got []string
	var links int
	eventually(t, within, fmt.Sprintf("agent %s connected to exactly %v", a.id, want), func() bool {
		if a.exited() {
			t.Fatalf("agent %s exited:\n%s", a.id, a.out.String())
		}
		var err error
		got, links, err = a.connectedNodes()
		return err == nil && slices.Equal(got, want) && links == len(want)
	})
}

// metrics reads the agent's /metrics as name{labels} -> value for the
// samples without labels or with the labels given in full.
func (a *clusterAgent) metrics() (map[string]float64, error) {
	code, b, err := a.adminGet("/metrics")
	if err != nil {
		return nil, err
	}
	if code != 200 {
		return nil, fmt.Errorf("agent %s /metrics: %d", a.id, code)
	}
	return parsePromText(string(b)), nil
}

// parsePromText reads the samples of a Prometheus text exposition, keyed
// by their name and labels as written.
func parsePromText(s string) map[string]float64 {
	out := map[string]float64{}
	for _, line := range strings.Split(s, "\n") {
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		i := strings.LastIndexByte(line, ' ')
		if i < 0 {
			continue
		}
		v, err := strconv.ParseFloat(line[i+1:], 64)
		if err != nil {
			continue
		}
		out[line[:i]] = v
	}
	return out
}

func nodeIDs(nodes []*clusterNode) []string {
	ids := make([]string, len(nodes))
	for i, n := range nodes {
		ids[i] = n.id
	}
	slices.Sort(ids)
	return ids
}

// haproxyLB is Debian's haproxy in front of nodes' HTTP ports, checking
// each node's readiness on /ready.
type haproxyLB struct {
	port int
	sock string
	cmd  *exec.Cmd
	out  *syncBuffer
	done chan struct{}
}

// startHAProxy runs haproxy balancing nodes round-robin, with health
// checks of GET /ready every 200 ms, down after one failure, up after two
// successes. It waits until every node is UP.
func startHAProxy(t *testing.T, nodes []*clusterNode) *haproxyLB {
	t.Helper()
	bin := haproxyBinary(t)
	dir := shortTempDir(t)
	h := &haproxyLB{port: freePort(t), sock: filepath.Join(dir, "s"), out: new(syncBuffer), done: make(chan struct{})}
	var servers strings.Builder
	for _, n := range nodes {
		fmt.Fprintf(&servers, "\tserver %s %s check\n", n.id, n.httpAddr())
	}
	cfg := fmt.Sprintf(`global
	maxconn 2000
	stats socket %s mode 600 level admin
	stats timeout 10s

defaults
	mode http
	timeout connect 2s
	timeout client 30s
	timeout server 30s
	timeout check 1s

frontend fe
	bind 127.0.0.1:%d
	default_backend nodes

backend nodes
	balance roundrobin
	option httpchk
	http-check send meth GET uri /ready ver HTTP/1.1 hdr Host health.test
	http-check expect status 200
	default-server inter 200ms fastinter 200ms downinter 200ms fall 1 rise 2
%s`, h.sock, h.port, servers.String())
	cfgPath := filepath.Join(dir, "haproxy.cfg")
	if err := os.WriteFile(cfgPath, []byte(cfg), 0o644); err != nil {
		t.Fatal(err)
	}
	h.cmd = exec.Command(bin, "-db", "-f", cfgPath)
	h.cmd.Stdout, h.cmd.Stderr = h.out, h.out
	if err := h.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	go func() { h.cmd.Wait(); close(h.done) }()
	t.Cleanup(func() {
		select {
		case <-h.done:
		default:
			h.cmd.Process.Kill()
			<-h.done
		}
		if t.Failed() {
			t.Logf("haproxy output:\n%s", h.out.String())
		}
	})
	eventually(t, 20*time.Second, "haproxy sees every node UP", func() bool {
		select {
		case <-h.done:
			t.Fatalf("haproxy exited:\n%s", h.out.String())
		default:
		}
		st, err := h.stats()
		if err != nil {
			return false
		}
		for _, n := range nodes {
			if st[n.id]["status"] != "UP" {
				return false
			}
		}
		return true
	})
	return h
}

// haproxyBinary finds haproxy, which Debian installs in /usr/sbin (not on
// every user's PATH).
func haproxyBinary(t *testing.T) string {
	t.Helper()
	if p, err := exec.LookPath("haproxy"); err == nil {
		return p
	}
	if _, err := os.Stat("/usr/sbin/haproxy"); err == nil {
		return "/usr/sbin/haproxy"
	}
	return needCommand(t, "haproxy")
}

// stats is haproxy's `show stat` for the backend's servers: server name
// -> field -> value.
func (h *haproxyLB) stats() (map[string]map[string]string, error) {
	c, err := net.DialTimeout("unix", h.sock, time.Second)
	if err != nil {
		return nil, err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(2 * time.Second))
	if _, err := io.WriteString(c, "show stat\n"); err != nil {
		return nil, err
	}
	b, err := io.ReadAll(c)
	if err != nil {
		return nil, err
	}
	text := strings.TrimPrefix(strings.TrimSpace(string(b)), "# ")
	r := csv.NewReader(strings.NewReader(text))
	r.FieldsPerRecord = -1
	rows, err := r.ReadAll()
	if err != nil {
		return nil, fmt.Errorf("haproxy stats: %w: %q", err, text)
	}
	if len(rows) < 2 {
		return nil, fmt.Errorf("haproxy stats: %q", text)
	}
	head := rows[0]
	out := map[string]map[string]string{}
	for _, row := range rows[1:] {
		m := map[string]string{}
		for i, v := range row {
			if i < len(head) {
				m[head[i]] = v
			}
		}
		if m["pxname"] == "nodes" {
			out[m["svname"]] = m
		}
	}
	return out, nil
}

// statInt is one numeric field of a server's stats (0 when empty).
func statInt(st map[string]map[string]string, server, field string) int64 {
	v, _ := strconv.ParseInt(st[server][field], 10, 64)
	return v
}

// url is the frontend's URL of path.
func (h *haproxyLB) url(path string) string {
	return fmt.Sprintf("http://127.0.0.1:%d%s", h.port, path)
}

// wrkResult is what wrk reported.
type wrkResult struct {
	requests                                  int64
	non2xx                                    int64
	connectErr, readErr, writeErr, timeoutErr int64
	out                                       string
}

func (r wrkResult) failed() int64 {
	return r.non2xx + r.connectErr + r.readErr + r.writeErr + r.timeoutErr
}

var (
	wrkRequests = regexp.MustCompile(`(\d+) requests in`)
	wrkNon2xx   = regexp.MustCompile(`Non-2xx or 3xx responses: (\d+)`)
	wrkSocket   = regexp.MustCompile(`Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)`)
)

// parseWrk reads wrk's summary.
func parseWrk(out string) (wrkResult, error) {
	r := wrkResult{out: out}
	m := wrkRequests.FindStringSubmatch(out)
	if m == nil {
		return r, fmt.Errorf("no request count in wrk's output:\n%s", out)
	}
	r.requests, _ = strconv.ParseInt(m[1], 10, 64)
	if m := wrkNon2xx.FindStringSubmatch(out); m != nil {
		r.non2xx, _ = strconv.ParseInt(m[1], 10, 64)
	}
	if m := wrkSocket.FindStringSubmatch(out); m != nil {
		r.connectErr, _ = strconv.ParseInt(m[1], 10, 64)
		r.readErr, _ = strconv.ParseInt(m[2], 10, 64)
		r.writeErr, _ = strconv.ParseInt(m[3], 10, 64)
		r.timeoutErr, _ = strconv.ParseInt(m[4], 10, 64)
	}
	return r, nil
}

// testCA is a CA made for one test and a server certificate it signed for
// the loopback addresses the nodes bind.
type testCA struct {
	caFile, certFile, keyFile string
}

// newTestCA writes a CA certificate and a node certificate (IP SANs
// 127.0.0.1-127.0.0.3, DNS localhost) with its key into a temporary
// directory.
func newTestCA(t *testing.T) *testCA {
	t.Helper()
	dir := t.TempDir()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	now := time.Now()
	caTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "Sluice Cluster Test CA"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	caCert, err := x509.ParseCertificate(caDER)
	if err != nil {
		t.Fatal(err)
	}
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	leafTmpl := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: "sluice node"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		DNSNames:    []string{"localhost", "nodes.sluice.test"},
		IPAddresses: []net.IP{net.ParseIP("127.0.0.1"), net.ParseIP("127.0.0.2"), net.ParseIP("127.0.0.3")},
	}
	leafDER, err := x509.CreateCertificate(rand.Reader, leafTmpl, caCert, &key.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	keyDER, err := x509.MarshalPKCS8PrivateKey(key)
	if err != nil {
		t.Fatal(err)
	}
	ca := &testCA{caFile: filepath.Join(dir, "ca.crt"), certFile: filepath.Join(dir, "node.crt"), keyFile: filepath.Join(dir, "node.key")}
	for _, f := range []struct {
		path, typ string
		der       []byte
	}{{ca.caFile, "CERTIFICATE", caDER}, {ca.certFile, "CERTIFICATE", leafDER}, {ca.keyFile, "PRIVATE KEY", keyDER}} {
		if err := os.WriteFile(f.path, pem.EncodeToMemory(&pem.Block{Type: f.typ, Bytes: f.der}), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return ca
}

// slowUpstream serves the sample application and /slow?size=N&chunk=K&every=D:
// N bytes of sampleupstream.Pattern, K bytes every D, flushed each time.
func slowUpstream(t *testing.T, name string) string {
	t.Helper()
	app := sampleupstream.Handler(name)
	mux := http.NewServeMux()
	mux.Handle("/", app)
	mux.HandleFunc("/slow", func(w http.ResponseWriter, r *http.Request) {
		q := r.URL.Query()
		size, _ := strconv.ParseInt(q.Get("size"), 10, 64)
		chunk, _ := strconv.ParseInt(q.Get("chunk"), 10, 64)
		every, _ := time.ParseDuration(q.Get("every"))
		if size <= 0 || chunk <= 0 || every <= 0 {
			http.Error(w, "want size, chunk and every", http.StatusBadRequest)
			return
		}
		w.Header().Set("Content-Type", "application/octet-stream")
		w.Header().Set("Content-Length", strconv.FormatInt(size, 10))
		rc := http.NewResponseController(w)
		body := sampleupstream.Pattern(size)
		tick := time.NewTicker(every)
		defer tick.Stop()
		for left := size; left > 0; left -= chunk {
			if _, err := io.CopyN(w, body, min(chunk, left)); err != nil {
				return
			}
			if rc.Flush() != nil {
				return
			}
			select {
			case <-tick.C:
			case <-r.Context().Done():
				return
			}
		}
	})
	return serveUpstream(t, mux)
}

// tcpGreeter serves name and a newline to every TCP connection, then
// echoes; it returns the tcp:// target.
func tcpGreeter(t *testing.T, name string) string {
	t.Helper()
	return tcpTarget(serveTCP(t, greetEchoHandler(name)))
}

// portFreeOn reports whether port can be bound on each ip.
func portFreeOn(port int, ips ...string) bool {
	for _, ip := range ips {
		l, err := net.Listen("tcp", net.JoinHostPort(ip, strconv.Itoa(port)))
		if err != nil {
			return false
		}
		l.Close()
	}
	return true
}

// freePortOn is freePort for a port free on every ip given.
func freePortOn(t *testing.T, ips ...string) int {
	t.Helper()
	for range 50 {
		if p := freePort(t); portFreeOn(p, ips...) {
			return p
		}
	}
	t.Fatalf("no port free on all of %v", ips)
	return 0
}

// tlsSerial handshakes with addr for serverName (trusting anything) and
// returns the serial of the certificate served.
func tlsSerial(addr, serverName string) (string, error) {
	d := &net.Dialer{Timeout: 5 * time.Second}
	c, err := tls.DialWithDialer(d, "tcp", addr, &tls.Config{ServerName: serverName, InsecureSkipVerify: true})
	if err != nil {
		return "", err
	}
	defer c.Close()
	certs := c.ConnectionState().PeerCertificates
	if len(certs) == 0 {
		return "", errors.New("no certificate")
	}
	return certs[0].SerialNumber.Text(16), nil
}

// httpsGetVia GETs https://host/ through addr, trusting anything.
func httpsGetVia(addr, host string) (int, string, error) {
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: insecureTLS(host),
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, addr)
		},
	}}
	defer client.CloseIdleConnections()
	resp, err := client.Get("https://" + host + "/")
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), nil
}

// startUnsharedAgent runs the agent binary in a mount namespace of its
// own (in a user namespace, as its root) where hosts is bind-mounted over
// /etc/hosts: its resolver sees the test's names, the machine's file is
// untouched. The process is the agent itself (unshare and sh exec it).
// Without user and mount namespaces the test skips (fails in CI).
func startUnsharedAgent(t *testing.T, bin, hosts, id string, args ...string) *clusterAgent {
	t.Helper()
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		skipOrFail(t, "unshare (util-linux) is needed for a private /etc/hosts")
	}
	if out, err := exec.Command(unshare, "--mount", "--map-root-user", "sh", "-c",
		`mount --bind "$0" /etc/hosts && cmp -s "$0" /etc/hosts`, hosts).CombinedOutput(); err != nil {
		skipOrFail(t, fmt.Sprintf("no private mount namespace here (unshare --mount --map-root-user): %v: %s", err, out))
	}
	admin := freePort(t)
	all := append([]string{"--mount", "--map-root-user", "sh", "-c", `mount --bind "$1" /etc/hosts && shift 2 && exec "$0" "$@"`,
		bin, hosts, "--",
		"-id", id, "-token", clusterToken, "-admin-listen", fmt.Sprintf("127.0.0.1:%d", admin)}, args...)
	return &clusterAgent{agentProcess: startAgentProcess(t, unshare, all...), id: id, admin: admin}
}

package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/connectivity"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/sluice-tunnel/sluice/agent"
	"github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/testwait"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The attacks of an unauthenticated client on the control port (the port
// is public on every real node), each with the bound it must stay under.

// TestPreauthStreamsCostNoMessageMemory: 16 connections without a token,
// each with 16 ListNodes streams that declare a 4 MiB message and send all
// of it but its last byte, grow the Caddy binary's RSS by less than
// 16 MiB, and every connection is closed: the credential is checked on a
// stream's headers, before gRPC reads a message.
func TestPreauthStreamsCostNoMessageMemory(t *testing.T) {
	caddyBin := caddyBinary(t)
	controlPort := freePort(t)
	caddyfile := writeCaddyfile(t, fmt.Sprintf(`	admin off
	sluice {
		listen 127.0.0.1:%d
		token preauth-token
	}`, controlPort), "")
	cmd, _ := launchProcess(t, caddyBin, "run", "--config", caddyfile, "--adapter", "caddyfile")
	control := fmt.Sprintf("127.0.0.1:%d", controlPort)
	eventually(t, 20*time.Second, "the control port listening", func() bool {
		c, err := net.Dial("tcp", control)
		if err == nil {
			c.Close()
		}
		return err == nil
	})
	base := pidRSS(t, cmd.Process.Pid)

	const conns, streams, declared = 16, 16, 4 << 20
	var peak atomic.Int64
	stopPolling := pollRSS(t, cmd.Process.Pid, &peak)
	var wg sync.WaitGroup
	closed := make(chan error, conns)
	for range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			closed <- h2TokenlessFlood(control, streams, declared, 15*time.Second)
		}()
	}
	wg.Wait()
	stopPolling()
	for range conns {
		if err := <-closed; err != nil {
			t.Fatal(err)
		}
	}
	grew := peak.Load() - base
	t.Logf("Caddy RSS %d MiB before, peak %d MiB during the flood (+%.1f MiB)", base>>20, peak.Load()>>20, float64(grew)/(1<<20))
	if grew >= 16<<20 {
		t.Fatalf("Caddy's RSS grew by %.1f MiB under the tokenless flood, want < 16 MiB", float64(grew)/(1<<20))
	}
}

// h2TokenlessFlood opens one HTTP/2 connection to the control address and
// on it streams ListNodes calls without a token, each declaring a message
// of declared bytes and sending all but its last byte, as fast as the
// connection takes them. It returns nil once the node closed the
// connection, an error if it did not within d.
func h2TokenlessFlood(addr string, streams, declared int, d time.Duration) error {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return err
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(d))
	eof := make(chan struct{})
	go func() {
		io.Copy(io.Discard, c)
		close(eof)
	}()
	write := func() error {
		if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
			return err
		}
		fr := http2.NewFramer(c, nil)
		if err := fr.WriteSettings(); err != nil {
			return err
		}
		var hdr bytes.Buffer
		enc := hpack.NewEncoder(&hdr)
		for _, f := range [][2]string{{":method", "POST"}, {":scheme", "http"}, {":authority", addr},
			{":path", "/sluice.tunnel.v1.Tunnel/ListNodes"}, {"content-type", "application/grpc"}, {"te", "trailers"}} {
			enc.WriteField(hpack.HeaderField{Name: f[0], Value: f[1]})
		}
		for i := range streams {
			if err := fr.WriteHeaders(http2.HeadersFrameParam{StreamID: uint32(2*i + 1), BlockFragment: hdr.Bytes(), EndHeaders: true}); err != nil {
				return err
			}
		}
		chunk := make([]byte, 16<<10)
		for i := range streams {
			id := uint32(2*i + 1)
			prefix := make([]byte, 5)
			binary.BigEndian.PutUint32(prefix[1:], uint32(declared))
			if err := fr.WriteData(id, false, prefix); err != nil {
				return err
			}
			for left := declared - 1; left > 0; left -= len(chunk) {
				if err := fr.WriteData(id, false, chunk[:min(left, len(chunk))]); err != nil {
					return err
				}
			}
		}
		return nil
	}
	write() // fails once the node closes the connection, as it must
	select {
	case <-eof:
		return nil
	case <-time.After(d):
		return fmt.Errorf("a tokenless connection was still open after %v", d)
	}
}

// TestAgentConnectsWhilePendingPoolIsHeld: while 256 unauthenticated
// connections from 16 addresses (all of max_pending_streams) are held open
// past the first-byte time, an agent still connects within 2 s: the
// oldest pending connection makes room for it.
func TestAgentConnectsWhilePendingPoolIsHeld(t *testing.T) {
	c := startCaddy(t, "")
	control := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	var held []net.Conn
	defer func() {
		for _, h := range held {
			h.Close()
		}
	}()
	for a := 1; a <= 16; a++ {
		from := fmt.Sprintf("127.0.%d.1", a) // 16 networks: no /24 bound applies
		for range 16 {
			held = append(held, holdPending(t, from, control))
		}
	}
	testwait.Until(t, 10*time.Second, "256 connections pending", func() bool { return c.mustStats(t).PendingConns == 256 })
	up := startUpstream(t, "pending")
	a := launchAgent(t, c.serverURL(), "agent-a", testToken, agent.Upstream{Host: "app.test", Target: up})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := a.WaitConnected(ctx); err != nil {
		t.Fatalf("agent did not connect within 2 s while 256 pending connections were held: %v (pending %d)", err, c.mustStats(t).PendingConns)
	}
	if st := c.mustStats(t); st.PendingConns > 256 {
		t.Fatalf("%d connections pending, more than max_pending_streams", st.PendingConns)
	}
}

// holdPending opens an HTTP/2 connection to the control address from the
// local address from that sends its preface and settings (so it is past
// the first-byte time) and then nothing: it waits for a credential that
// never comes.
func holdPending(t testing.TB, from, control string) net.Conn {
	t.Helper()
	d := net.Dialer{LocalAddr: &net.TCPAddr{IP: net.ParseIP(from)}}
	c, err := d.Dial("tcp", control)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Write([]byte(http2.ClientPreface)); err != nil {
		t.Fatal(err)
	}
	if err := http2.NewFramer(c, nil).WriteSettings(); err != nil {
		t.Fatal(err)
	}
	go io.Copy(io.Discard, c)
	return c
}

// TestAgentConnectsFromAFloodedSlash64: 64 unauthenticated connections
// from 64 addresses of one IPv6 /64 hold at most their network's share of
// the pending pool (four times max_pending_streams_per_address), and an
// agent connecting from that /64 gets in within 2 s. Loopback has a single
// IPv6 address, so the test runs again in a network namespace of its own
// whose loopback has a /64 of them.
func TestAgentConnectsFromAFloodedSlash64(t *testing.T) {
	const prefix = "fd00:5109:1ce::"
	if os.Getenv("SLUICE_TEST_NETNS") == "" {
		runInNetns(t, "TestAgentConnectsFromAFloodedSlash64", prefix, 65)
		return
	}
	c := startCaddyWith(t, caddyOptions{Listen: "[" + prefix + "1]:{CONTROL}", Sluice: "max_pending_streams_per_address 4"}, "")
	control := net.JoinHostPort(prefix+"1", strconv.Itoa(c.controlPort))
	var held []net.Conn
	defer func() {
		for _, h := range held {
			h.Close()
		}
	}()
	for i := 2; i <= 65; i++ {
		held = append(held, holdPending(t, fmt.Sprintf("%s%x", prefix, i), control))
	}
	testwait.Until(t, 10*time.Second, "the /64's share pending", func() bool { return c.mustStats(t).PendingConns == 16 })
	up := startUpstream(t, "slash64")
	a := launchAgent(t, "grpc://"+control, "agent-a", testToken, agent.Upstream{Host: "app.test", Target: up})
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	if err := a.WaitConnected(ctx); err != nil {
		t.Fatalf("agent did not connect within 2 s from a /64 holding 64 pending connections: %v", err)
	}
	if st := c.mustStats(t); st.PendingConns > 16 {
		t.Fatalf("%d connections pending from one /64, want at most 16", st.PendingConns)
	}
}

// runInNetns runs test again in a new network namespace (unshare, as an
// unprivileged user namespace's root) whose loopback also has the
// addresses prefix+1 … prefix+n, and fails when it fails.
func runInNetns(t *testing.T, test, prefix string, n int) {
	unshare, err := exec.LookPath("unshare")
	if err != nil {
		skipOrFail(t, "unshare (util-linux) is needed for a network namespace")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		skipOrFail(t, "ip (iproute2) is needed for a network namespace")
	}
	script := "set -e; ip link set lo up; i=1; while [ $i -le " + strconv.Itoa(n) + " ]; do " +
		"ip -6 addr add " + prefix + "$(printf %x $i)/128 dev lo nodad; i=$((i+1)); done; exec \"$@\""
	cmd := exec.Command(unshare, "--net", "--map-root-user", "sh", "-c", script, "sh",
		os.Args[0], "-test.run=^"+test+"$", "-test.count=1", "-test.v", "-test.timeout=2m")
	cmd.Env = append(os.Environ(), "SLUICE_TEST_NETNS=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: "+test) {
		if strings.Contains(string(out), "unshare failed") || strings.Contains(string(out), "Operation not permitted") {
			skipOrFail(t, "no network namespace here: "+strings.TrimSpace(string(out)))
		}
		t.Fatalf("%s in a network namespace: %v\n%s", test, err, out)
	}
	t.Logf("%s passed in a network namespace", test)
}

// skipOrFail skips a test that needs what this machine lacks, except in CI,
// which installs it.
func skipOrFail(t *testing.T, why string) {
	t.Helper()
	if os.Getenv("CI") != "" {
		t.Fatal(why)
	}
	t.Skip(why)
}

// TestLanePrefaceFloodIsBounded: of 200 connections that send only the
// first byte of a lane preface, at most max_pending_streams_per_address
// are open 3 s later, and all are closed soon after: a preface leaves the
// pending pool only once its ticket checked out.
func TestLanePrefaceFloodIsBounded(t *testing.T) {
	c := startCaddy(t, "")
	control := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	var open atomic.Int64
	start := time.Now()
	for range 200 {
		conn, err := net.Dial("tcp", control)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if _, err := conn.Write([]byte("S")); err != nil {
			t.Fatal(err)
		}
		open.Add(1)
		go func() {
			io.Copy(io.Discard, conn)
			open.Add(-1)
		}()
	}
	testwait.Until(t, 3*time.Second-time.Since(start), "at most 16 open", func() bool { return open.Load() <= 16 })
	testwait.Until(t, 5*time.Second, "all closed", func() bool { return open.Load() == 0 })
	testwait.Until(t, 5*time.Second, "none pending", func() bool { return c.mustStats(t).PendingConns == 0 })
}

// TestWrongTokensAreCountedAndCutOff: 1,000 Connect attempts with wrong
// tokens are each refused with UNAUTHENTICATED and counted, a connection
// is closed at its third, and the node logs them through its throttle
// (a few lines, not a thousand).
func TestWrongTokensAreCountedAndCutOff(t *testing.T) {
	c := startCaddyWith(t, caddyOptions{CaptureLog: true}, "")
	const attempts = 1000
	made, conns := 0, 0
	for made < attempts {
		cc := dialControl(t, fmt.Sprintf("127.0.0.1:%d", c.controlPort))
		conns++
		for perConn := 1; perConn <= 3 && made < attempts; perConn++ {
			ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(),
				"authorization", fmt.Sprintf("Bearer guess-%d", made)), 10*time.Second)
			_, err := tunnelpb.NewTunnelClient(cc).ListNodes(ctx, &tunnelpb.ListNodesRequest{})
			cancel()
			made++
			// The third may find the connection closed before its
			// answer arrives.
			if code := status.Code(err); code != codes.Unauthenticated && (perConn < 3 || code != codes.Unavailable) {
				t.Fatalf("attempt %d: %v, want Unauthenticated", made, err)
			}
			if perConn == 3 && !waitNotReady(cc, 5*time.Second) {
				t.Fatalf("connection %d still open after 3 wrong tokens", conns)
			}
		}
		cc.Close()
	}
	if got := c.mustStats(t).AuthFailures; got != attempts {
		t.Fatalf("%d failures counted, want %d", got, attempts)
	}
	if conns < attempts/3 {
		t.Fatalf("%d wrong tokens took only %d connections", attempts, conns)
	}
	lines := countLogLines(t, c.logPath, "agent authentication failed")
	if lines == 0 || lines > 50 {
		t.Fatalf("%d log lines for %d failures, want a few", lines, attempts)
	}
}

// dialControl connects a gRPC client to addr and waits until it is ready.
func dialControl(t testing.TB, addr string) *grpc.ClientConn {
	t.Helper()
	cc, err := grpc.NewClient(addr, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cc.Close() })
	cc.Connect()
	testwait.Until(t, 10*time.Second, "the control connection ready", func() bool { return cc.GetState() == connectivity.Ready })
	return cc
}

// waitNotReady reports whether cc leaves the ready state within d.
func waitNotReady(cc *grpc.ClientConn, d time.Duration) bool {
	ctx, cancel := context.WithTimeout(context.Background(), d)
	defer cancel()
	for cc.GetState() == connectivity.Ready {
		if !cc.WaitForStateChange(ctx, connectivity.Ready) {
			return false
		}
	}
	return true
}

// countLogLines counts the lines of the log at path that contain s.
func countLogLines(t testing.TB, path, s string) int {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), s)
}

// TestUnixSocketControlAfterOverlappingConnections: on a unix-socket
// listen, whose peers all share one address, 20 rounds of two overlapping
// connections leave the pending pool empty, and then three agents
// connecting at once are all admitted.
func TestUnixSocketControlAfterOverlappingConnections(t *testing.T) {
	sock := filepath.Join(shortTempDir(t), "control.sock")
	c := startCaddyWith(t, caddyOptions{Listen: "unix/" + sock, Sluice: "max_pending_streams_per_address 1"}, "")
	for range 20 {
		a, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		b, err := net.Dial("unix", sock)
		if err != nil {
			t.Fatal(err)
		}
		a.Write([]byte(http2.ClientPreface))
		a.Close()
		b.Close()
	}
	testwait.Until(t, 5*time.Second, "none pending", func() bool {
		st, ok := unixStats(sock)
		return ok && st == 0
	})
	var wg sync.WaitGroup
	errs := make(chan error, 3)
	for i := range 3 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- advertiseOver(t, "unix://"+sock, fmt.Sprintf("agent-%d", i))
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	_ = c
}

// unixStats returns the pending connections of the node listening on sock.
func unixStats(sock string) (int, bool) {
	for _, st := range caddymodule.Stats() {
		if strings.Contains(st.Listen, sock) {
			return st.PendingConns, true
		}
	}
	return 0, false
}

// advertiseOver connects to target with the token, advertises as id, and
// returns nil once the node acknowledged it.
func advertiseOver(t testing.TB, target, id string) error {
	cc, err := grpc.NewClient(target, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		return err
	}
	t.Cleanup(func() { cc.Close() })
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+testToken), 10*time.Second)
	t.Cleanup(cancel)
	st, err := tunnelpb.NewTunnelClient(cc).Connect(ctx)
	if err != nil {
		return fmt.Errorf("%s: %w", id, err)
	}
	if err := st.Send(&tunnelpb.Frame{Kind: &tunnelpb.Frame_Advertise{Advertise: &tunnelpb.Advertise{
		AgentId: id, InitialWindow: tunnelcore.InitialWindow, Routes: []*tunnelpb.Route{{Host: id + ".test"}},
	}}}); err != nil {
		return fmt.Errorf("%s: %w", id, err)
	}
	f, err := st.Recv()
	if err != nil || f.GetAdvertiseAck() == nil {
		return fmt.Errorf("%s: no AdvertiseAck: %v %v", id, f, err)
	}
	return nil
}

// shortTempDir is a temporary directory with a path short enough for a
// unix socket in it (108 bytes at most), removed when the test ends.
func shortTempDir(t testing.TB) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "sl")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// pidRSS is the resident set size of process pid.
func pidRSS(t testing.TB, pid int) int64 {
	t.Helper()
	rss, err := readRSS(pid)
	if err != nil {
		t.Skipf("no RSS for process %d: %v", pid, err)
	}
	return rss
}

func readRSS(pid int) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseInt(strings.Fields(rest)[0], 10, 64)
			return kb << 10, err
		}
	}
	return 0, fmt.Errorf("no VmRSS in /proc/%d/status", pid)
}

// pollRSS records the peak RSS of process pid in peak every 20 ms until
// the returned stop is called (which takes one last reading).
func pollRSS(t testing.TB, pid int, peak *atomic.Int64) (stop func()) {
	done, stopped := make(chan struct{}), make(chan struct{})
	read := func() {
		if rss, err := readRSS(pid); err == nil && rss > peak.Load() {
			peak.Store(rss)
		}
	}
	go func() {
		defer close(stopped)
		tick := time.NewTicker(20 * time.Millisecond)
		defer tick.Stop()
		for {
			select {
			case <-done:
				read()
				return
			case <-tick.C:
				read()
			}
		}
	}()
	return func() { close(done); <-stopped }
}

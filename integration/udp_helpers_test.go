package integration

import (
	"bytes"
	"context"
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"
)

// The real UDP programs of the UDP tests (dnsmasq, dig, dnsperf, iperf3;
// .ci/run installs them) and the loopback UDP servers and clients they
// share.

// udpTarget is the udp:// target of a loopback port.
func udpTarget(port int) string { return "udp://" + loopback(port) }

// freeUDPPort returns a loopback port free for both UDP and TCP a moment
// ago (iperf3 takes both on one port), never one freePort handed out.
func freeUDPPort(t testing.TB) int {
	t.Helper()
	for range 100 {
		pc, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		port := pc.LocalAddr().(*net.UDPAddr).Port
		pc.Close()
		l, err := net.Listen("tcp", loopback(port))
		if err != nil {
			continue
		}
		l.Close()
		if portsHandedOut.take(port) {
			return port
		}
	}
	t.Fatal("no loopback port free for UDP and TCP")
	return 0
}

// udpPortRangeGlobal is the sluice global block that lets agents claim
// UDP ports lo..hi, bound on loopback.
func udpPortRangeGlobal(lo, hi int) string {
	return fmt.Sprintf("\tsluice {\n\t\tudp_port_range %d-%d\n\t\tudp_bind 127.0.0.1\n\t}\n", lo, hi)
}

// udpLayer4Global is a layer4 UDP server on loopback port whose route is
// `sluice args` (a route name, or nothing to route by port).
func udpLayer4Global(port int, args string) string {
	return fmt.Sprintf("\tlayer4 {\n\t\tudp/127.0.0.1:%d {\n\t\t\troute {\n\t\t\t\tsluice %s\n\t\t\t}\n\t\t}\n\t}\n", port, args)
}

// serveUDPEcho runs a UDP echo on a new loopback socket and returns its
// port: each datagram goes back to its sender, prefixed with prefix.
// senders collects the addresses it heard from (the agent's sockets).
type udpEcho struct {
	port    int
	mu      sync.Mutex
	senders map[string]int
}

func serveUDPEcho(t testing.TB, prefix string) *udpEcho {
	t.Helper()
	pc, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	pc.SetReadBuffer(8 << 20)
	e := &udpEcho{port: pc.LocalAddr().(*net.UDPAddr).Port, senders: map[string]int{}}
	done := make(chan struct{})
	go func() {
		defer close(done)
		buf := make([]byte, 65535)
		for {
			n, from, err := pc.ReadFromUDP(buf)
			if err != nil {
				return
			}
			e.mu.Lock()
			e.senders[from.String()]++
			e.mu.Unlock()
			pc.WriteToUDP(append([]byte(prefix), buf[:n]...), from)
		}
	}()
	t.Cleanup(func() { pc.Close(); <-done })
	return e
}

// datagrams is how many datagrams the echo answered.
func (e *udpEcho) datagrams() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	n := 0
	for _, c := range e.senders {
		n += c
	}
	return n
}

// distinctSenders is how many source addresses the echo heard from.
func (e *udpEcho) distinctSenders() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.senders)
}

// udpAsk sends msg from c until a reply comes (at most tries times,
// each waiting wait) and returns it: UDP may lose a datagram, so a
// client retries as a DNS resolver does.
func udpAsk(c *net.UDPConn, msg []byte, tries int, wait time.Duration) ([]byte, error) {
	buf := make([]byte, 65535)
	var lastErr error
	for range tries {
		if _, err := c.Write(msg); err != nil {
			return nil, err
		}
		c.SetReadDeadline(time.Now().Add(wait))
		n, err := c.Read(buf)
		if err == nil {
			return buf[:n], nil
		}
		lastErr = err
	}
	return nil, fmt.Errorf("no reply after %d tries: %w", tries, lastErr)
}

// dialUDP connects a new loopback UDP socket to port.
func dialUDP(t testing.TB, port int) *net.UDPConn {
	t.Helper()
	c, err := net.DialUDP("udp", nil, &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1), Port: port})
	if err != nil {
		t.Fatal(err)
	}
	c.SetReadBuffer(4 << 20)
	t.Cleanup(func() { c.Close() })
	return c
}

// dnsRecords are the names startDnsmasq answers, with their addresses.
var dnsRecords = map[string]string{
	"www.example.test":   "192.0.2.10",
	"api.example.test":   "192.0.2.20",
	"db.internal.test":   "10.1.2.3",
	"bench.example.test": "192.0.2.99",
}

// startDnsmasq runs dnsmasq as the private resolver on a loopback UDP
// port, answering dnsRecords (and every name under bench.example.test,
// for the load) and nothing else; it returns the port once it answers.
func startDnsmasq(t *testing.T) int {
	t.Helper()
	bin := needCommand(t, "dnsmasq")
	port := freeUDPPort(t)
	args := []string{"--no-daemon", "--conf-file=/dev/null", "--no-resolv", "--no-hosts", "--no-poll",
		"--listen-address=127.0.0.1", "--bind-interfaces", "--port=" + strconv.Itoa(port),
		"--cache-size=10000", "--pid-file=", "--user=" + currentUser(), "--log-facility=-",
		"--address=/bench.example.test/192.0.2.99"}
	for name, addr := range dnsRecords {
		args = append(args, "--host-record="+name+","+addr)
	}
	startProcess(t, bin, args...)
	c := dialUDP(t, port)
	eventually(t, 10*time.Second, "dnsmasq answering", func() bool {
		_, err := udpAsk(c, dnsQuery(1, "www.example.test"), 1, 200*time.Millisecond)
		return err == nil
	})
	return port
}

// currentUser is the user dnsmasq keeps (it drops root for nobody
// otherwise, which may not read its files).
func currentUser() string {
	out, err := exec.Command("id", "-un").Output()
	if err != nil {
		return "root"
	}
	return strings.TrimSpace(string(out))
}

// dnsQuery is a DNS query for the A record of name, with id.
func dnsQuery(id uint16, name string) []byte {
	b := binary.BigEndian.AppendUint16(nil, id)
	b = append(b, 0x01, 0x00, 0, 1, 0, 0, 0, 0, 0, 0) // RD; one question
	for _, label := range strings.Split(name, ".") {
		b = append(b, byte(len(label)))
		b = append(b, label...)
	}
	return append(b, 0, 0, 1, 0, 1) // root; A; IN
}

// dig runs dig for name's A record at 127.0.0.1:port and returns the
// addresses of its short answer.
func dig(t *testing.T, port int, name string) []string {
	t.Helper()
	bin := needCommand(t, "dig")
	out, err := exec.Command(bin, "@127.0.0.1", "-p", strconv.Itoa(port), "+short", "+tries=3", "+time=2", name, "A").CombinedOutput()
	if err != nil {
		t.Fatalf("dig %s: %v\n%s", name, err, out)
	}
	return strings.Fields(string(out))
}

// dnsperfResult is what one dnsperf run reports.
type dnsperfResult struct {
	Sent, Completed, Lost int
	// Latencies are each answered query's latency, sorted.
	Latencies []time.Duration
	QPS       float64
}

// percentile returns the p-th percentile (0..100) of the sorted
// latencies.
func (r dnsperfResult) percentile(p float64) time.Duration {
	if len(r.Latencies) == 0 {
		return 0
	}
	i := int(math.Ceil(p/100*float64(len(r.Latencies)))) - 1
	return r.Latencies[max(i, 0)]
}

// runDnsperf sends queries A queries for names under bench.example.test
// (each a distinct name, 1000 names repeated) to 127.0.0.1:port, at most
// concurrency outstanding from as many client sockets, and returns the
// result with each query's latency (dnsperf -v).
func runDnsperf(t *testing.T, port, queries, concurrency int) dnsperfResult {
	t.Helper()
	bin := needCommand(t, "dnsperf")
	const names = 1000
	var data bytes.Buffer
	for i := range names {
		fmt.Fprintf(&data, "q%d.bench.example.test A\n", i)
	}
	file := filepath.Join(t.TempDir(), "queries")
	if err := os.WriteFile(file, data.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, "-s", "127.0.0.1", "-p", strconv.Itoa(port), "-d", file,
		"-n", strconv.Itoa(queries/names), "-c", strconv.Itoa(concurrency), "-q", strconv.Itoa(concurrency),
		"-t", "5", "-v")
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("dnsperf: %v\n%s", err, out)
	}
	return parseDnsperf(t, string(out))
}

// parseDnsperf reads dnsperf -v's output: a "> RCODE name type latency"
// line per answered query, then the statistics.
func parseDnsperf(t *testing.T, out string) dnsperfResult {
	t.Helper()
	var r dnsperfResult
	for _, line := range strings.Split(out, "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) == 5 && f[0] == ">":
			if f[1] != "NOERROR" {
				t.Errorf("dnsperf: %s", line)
			}
			s, err := strconv.ParseFloat(f[4], 64)
			if err != nil {
				t.Fatalf("dnsperf latency %q: %v", line, err)
			}
			r.Latencies = append(r.Latencies, time.Duration(s*float64(time.Second)))
		case len(f) >= 3 && f[0] == "Queries" && f[1] == "sent:":
			r.Sent, _ = strconv.Atoi(f[2])
		case len(f) >= 3 && f[0] == "Queries" && f[1] == "completed:":
			r.Completed, _ = strconv.Atoi(f[2])
		case len(f) >= 3 && f[0] == "Queries" && f[1] == "lost:":
			r.Lost, _ = strconv.Atoi(f[2])
		case len(f) >= 4 && f[0] == "Queries" && f[1] == "per" && f[2] == "second:":
			r.QPS, _ = strconv.ParseFloat(f[3], 64)
		}
	}
	slices.Sort(r.Latencies)
	if r.Sent == 0 {
		t.Fatalf("dnsperf reported no queries sent:\n%s", out)
	}
	return r
}

// startIperf3 runs an iperf3 server on a loopback port (TCP for its
// control connection, UDP for -u tests) and returns the port.
func startIperf3(t *testing.T) int {
	t.Helper()
	bin := needCommand(t, "iperf3")
	port := freeUDPPort(t)
	startProcess(t, bin, "-s", "-B", "127.0.0.1", "-p", strconv.Itoa(port))
	eventually(t, 10*time.Second, "iperf3 listening", func() bool {
		c, err := net.DialTimeout("tcp", loopback(port), time.Second)
		if err != nil {
			return false
		}
		c.Close()
		return true
	})
	return port
}

// iperfUDP is what an iperf3 -u run measured at the receiver.
type iperfUDP struct {
	Bitrate     float64 // bits per second received
	Packets     int
	LostPackets int
	LostPercent float64
	JitterMs    float64
}

// iperfReport is the part of iperf3 -J's report runIperf3UDP reads.
type iperfReport struct {
	End struct {
		SumReceived struct {
			BitsPerSecond float64 `json:"bits_per_second"`
		} `json:"sum_received"`
		Sum struct {
			BitsPerSecond float64 `json:"bits_per_second"`
			Packets       int     `json:"packets"`
			LostPackets   int     `json:"lost_packets"`
			LostPercent   float64 `json:"lost_percent"`
			JitterMs      float64 `json:"jitter_ms"`
		} `json:"sum"`
	} `json:"end"`
	Error string `json:"error"`
}

// runIperf3UDP runs an iperf3 -u client against 127.0.0.1:port at rate
// (iperf3's -b, e.g. "100M") for secs seconds with datagrams of length
// bytes, and returns the receiver's figures. The server's port is busy
// with one test at a time: a refused start ("the server is busy") is
// tried again, bounded.
func runIperf3UDP(t *testing.T, port int, rate string, secs, length int) iperfUDP {
	t.Helper()
	bin := needCommand(t, "iperf3")
	var out []byte
	var rep iperfReport
	for try := 0; ; try++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(secs+30)*time.Second)
		var err error
		// -w: 4 MiB socket buffers (as far as rmem_max allows), so that
		// the receiver's socket is not the bottleneck.
		out, err = exec.CommandContext(ctx, bin, "-c", "127.0.0.1", "-p", strconv.Itoa(port), "-u",
			"-b", rate, "-t", strconv.Itoa(secs), "-l", strconv.Itoa(length), "-w", "4M", "-J").Output()
		cancel()
		rep = iperfReport{}
		jerr := json.Unmarshal(out, &rep)
		if err == nil && jerr == nil && rep.Error == "" {
			break
		}
		// The server runs one test at a time: it refuses a start while
		// busy, and resets the control connection of one that arrives as
		// it finishes the previous (a readiness probe's, say). Both are
		// tried again after a pause, bounded.
		retry := bytes.Contains(out, []byte("busy")) || strings.Contains(rep.Error, "reset by peer")
		if try == 4 || !retry {
			t.Fatalf("iperf3 -u -b %s: %v, report %v %q\n%s", rate, err, jerr, rep.Error, out)
		}
		select {
		case <-time.After(200 * time.Millisecond):
		case <-t.Context().Done():
			t.Fatal(t.Context().Err())
		}
	}
	s := rep.End.Sum
	if r := rep.End.SumReceived.BitsPerSecond; r > 0 {
		s.BitsPerSecond = r // the receiver's (3.1+); "sum" is the sender's
	}
	return iperfUDP{Bitrate: s.BitsPerSecond, Packets: s.Packets, LostPackets: s.LostPackets, LostPercent: s.LostPercent, JitterMs: s.JitterMs}
}

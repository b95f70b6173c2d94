package integration

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
)

// udpSites serves the metrics handler (metrics.test), for the UDP tests'
// counters.
const udpSites = "http://metrics.test:{HTTP} {\n\tmetrics\n}\n"

// udpNodeGlobal is the sluice block of the UDP tests: the node's name for
// its metrics, and its flow limits (1000 clients of one test share
// 127.0.0.1).
const udpNodeGlobal = "\tsluice {\n\t\tnode_id metrics-node\n\t\tmax_udp_flows_per_address 4096\n\t}\n"

// TestDNSThroughUDP is DNS end to end with real programs: dnsmasq as the
// private resolver behind the agent, dig and dnsperf in front of Caddy's
// layer4 UDP server (`sluice dns`) and of a UDP port the node binds for
// the agent (udp_port_range). Every answer is the resolver's; 10,000
// queries at concurrency 50 lose none; the latency the tunnel adds is
// logged (p50 and p99, tunnel against direct).
func TestDNSThroughUDP(t *testing.T) {
	resolver := startDnsmasq(t)
	l4Port, claimPort := freeUDPPort(t), freeUDPPort(t)
	c := startCaddyWith(t, caddyOptions{Global: udpNodeGlobal + udpLayer4Global(l4Port, "dns") + udpPortRangeGlobal(claimPort, claimPort)}, udpSites)
	startAgent(t, c.serverURL(), "agent-dns",
		agent.Upstream{Name: "dns", Target: udpTarget(resolver)},
		agent.Upstream{Name: "dns-port", ListenPort: claimPort, Target: udpTarget(resolver)})
	paths := []struct {
		name string
		port int
	}{{"direct", resolver}, {"layer4", l4Port}, {"claimed port", claimPort}}

	t.Run("dig", func(t *testing.T) {
		for _, p := range paths {
			for name, addr := range dnsRecords {
				if got := dig(t, p.port, name); !slices.Equal(got, []string{addr}) {
					t.Errorf("%s: dig %s = %v, want [%s]", p.name, name, got, addr)
				}
			}
			if got := dig(t, p.port, "nowhere.invalid"); len(got) != 0 {
				t.Errorf("%s: an unknown name answered %v", p.name, got)
			}
		}
	})

	t.Run("dnsperf", func(t *testing.T) {
		results := map[string]dnsperfResult{}
		for _, p := range paths {
			r := runDnsperf(t, p.port, 10000, 50)
			if r.Sent != 10000 || r.Completed != 10000 || r.Lost != 0 || len(r.Latencies) != 10000 {
				t.Errorf("%s: sent %d, completed %d, lost %d, %d answers timed; want 10000 answered", p.name, r.Sent, r.Completed, r.Lost, len(r.Latencies))
			}
			results[p.name] = r
		}
		d := results["direct"]
		for _, p := range paths {
			r := results[p.name]
			t.Logf("%-12s %7.0f q/s  p50 %8v  p99 %8v  (added: p50 %8v, p99 %8v)", p.name, r.QPS,
				r.percentile(50), r.percentile(99), r.percentile(50)-d.percentile(50), r.percentile(99)-d.percentile(99))
		}
	})

	t.Run("metrics", func(t *testing.T) {
		text := scrapeMetrics(t, c)
		for _, dir := range []string{"to_agent", "to_client"} {
			if v := nodeMetric(text, "sluice_udp_datagrams_total", "direction", dir); v < 20000 {
				t.Errorf("sluice_udp_datagrams_total{direction=%q} = %v, want the 20000+ of the load", dir, v)
			}
			if v := nodeMetric(text, "sluice_udp_bytes_total", "direction", dir); v <= 0 {
				t.Errorf("sluice_udp_bytes_total{direction=%q} = %v", dir, v)
			}
		}
		if v := nodeMetric(text, "sluice_udp_flows_total"); v < 100 {
			t.Errorf("sluice_udp_flows_total = %v, want a flow per dnsperf and dig socket", v)
		}
		metricsLint(t, text)
	})
}

// TestIperf3UDPThroughTunnel: iperf3 -u at several rates, direct and
// through the tunnel (its control connection through the port's TCP
// twin): the figures are logged, and at the lowest rate the tunnel loses
// (almost) nothing.
func TestIperf3UDPThroughTunnel(t *testing.T) {
	server := startIperf3(t)
	port := freeUDPPort(t)
	global := udpNodeGlobal + udpPortRangeGlobal(port, port) + portRangeGlobal(port, port)
	c := startCaddyWith(t, caddyOptions{Global: global}, udpSites)
	ag := startAgent(t, c.serverURL(), "agent-iperf",
		agent.Upstream{Name: "iperf", ListenPort: port, Target: udpTarget(server)},
		agent.Upstream{Name: "iperf-control", ListenPort: port, Target: tcpTarget(server)})
	// The node binds a claimed port before it acknowledges the route. No
	// probe connection: one through the claimed TCP port would reach the
	// iperf3 server, which serves one test at a time, and could hold it
	// while the first run starts.
	for _, r := range ag.Status().Routes {
		if r.Ack != agent.AckAccepted {
			t.Fatalf("route %s: %s %s", r.Name, r.Ack, r.Reason)
		}
	}
	for _, rate := range []string{"10M", "100M", "500M"} {
		direct := runIperf3UDP(t, server, rate, 2, 1400)
		tunnel := runIperf3UDP(t, port, rate, 2, 1400)
		t.Logf("-b %-5s direct: %6.1f Mbit/s, loss %5.2f%%, jitter %.3f ms | tunnel: %6.1f Mbit/s, loss %5.2f%%, jitter %.3f ms",
			rate, direct.Bitrate/1e6, direct.LostPercent, direct.JitterMs, tunnel.Bitrate/1e6, tunnel.LostPercent, tunnel.JitterMs)
		text := scrapeMetrics(t, c)
		var drops []string
		for _, reason := range []string{"send_queue_full", "receive_queue_full", "too_large", "max_udp_flows"} {
			drops = append(drops, fmt.Sprintf("%s %v", reason, nodeMetric(text, "sluice_udp_datagrams_dropped_total", "reason", reason)))
		}
		t.Logf("         node drops so far: %s", strings.Join(drops, ", "))
		if rate == "10M" && tunnel.LostPercent > 1 {
			t.Errorf("at 10 Mbit/s the tunnel lost %.2f%% (%d of %d datagrams)", tunnel.LostPercent, tunnel.LostPackets, tunnel.Packets)
		}
	}
}

// TestUDPLargeDatagram: a datagram of 65,000 bytes crosses whole, each
// way, through a port the node binds (caddy-l4's UDP servers read into
// 9000-byte buffers, so through them the largest is 9000).
func TestUDPLargeDatagram(t *testing.T) {
	echo := serveUDPEcho(t, "")
	port := freeUDPPort(t)
	c := startCaddyWith(t, caddyOptions{Global: udpNodeGlobal + udpPortRangeGlobal(port, port)}, udpSites)
	startAgent(t, c.serverURL(), "agent-large", agent.Upstream{Name: "echo", ListenPort: port, Target: udpTarget(echo.port)})
	client := dialUDP(t, port)
	client.SetWriteBuffer(1 << 20)
	for _, n := range []int{1, 1472, 9000, 65000, 65507} {
		msg := bytes.Repeat([]byte(strconv.Itoa(n%10)), n)
		got, err := udpAsk(client, msg, 10, 2*time.Second)
		if err != nil || !bytes.Equal(got, msg) {
			t.Fatalf("%d-byte datagram: got %d bytes back, %v", n, len(got), err)
		}
	}
}

// TestUDPThousandClients: 1,000 client sockets at once, each its own
// address, each get their own replies through one agent that gives each
// flow an upstream socket of its own; once the clients go quiet the flows
// end after the route's idle timeout, on the node and on the agent, whose
// upstream sockets close. (A burst of a thousand first datagrams may
// overflow caddy-l4's socket buffer, which it does not size: the clients
// retry, as DNS clients do. The idle timeout is longer than the retries
// may take, so that no flow ends before the last one opened.)
func TestUDPThousandClients(t *testing.T) {
	const clients = 1000
	echo := serveUDPEcho(t, "re:")
	l4Port := freeUDPPort(t)
	c := startCaddyWith(t, caddyOptions{Global: udpNodeGlobal + udpLayer4Global(l4Port, "echo")}, udpSites)
	startAgent(t, c.serverURL(), "agent-many", agent.Upstream{Name: "echo", Target: udpTarget(echo.port), UDPIdleTimeout: 8 * time.Second})
	conns := make([]*net.UDPConn, clients)
	for i := range conns {
		conns[i] = dialUDP(t, l4Port)
	}
	start := time.Now()
	var wg sync.WaitGroup
	errs := make(chan error, clients)
	for i, conn := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := fmt.Sprintf("client %d from %s", i, conn.LocalAddr())
			got, err := udpAsk(conn, []byte(msg), 10, time.Second)
			if err == nil && string(got) != "re:"+msg {
				err = fmt.Errorf("client %d got %q", i, got)
			}
			errs <- err
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("%d clients answered in %v; the upstream saw %d datagrams", clients, time.Since(start), echo.datagrams())
	if n := echo.distinctSenders(); n != clients {
		t.Errorf("the upstream heard from %d agent sockets, want one per client (%d)", n, clients)
	}
	if n := agentUpstreamSockets(t, echo.port); n != clients {
		t.Errorf("the agent has %d sockets to the upstream open, want %d", n, clients)
	}
	eventually(t, 30*time.Second, "the idle flows to end and the agent's sockets to close", func() bool {
		return agentUpstreamSockets(t, echo.port) == 0 && nodeMetric(scrapeMetrics(t, c), "sluice_udp_flows_active") == 0
	})
}

// agentUpstreamSockets counts the UDP sockets of this network namespace
// connected to 127.0.0.1:port: the in-process agent's upstream sockets.
func agentUpstreamSockets(t testing.TB, port int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/udp")
	if err != nil {
		t.Skipf("no /proc/net/udp: %v", err)
	}
	want := fmt.Sprintf("0100007F:%04X", port)
	n := 0
	for _, line := range strings.Split(string(b), "\n")[1:] {
		if f := strings.Fields(line); len(f) > 2 && f[2] == want {
			n++
		}
	}
	return n
}

// TestUDPStalledUpstreamDoesNotSlowTCP is the head-of-line test: clients
// send a steady 200 Mbit/s of datagrams to a UDP upstream that never
// reads, through the same agent session as a TCP download. The stalled
// upstream's socket fills and its kernel drops the rest (counted in
// /proc/net/snmp's RcvbufErrors: UDP gives a sender no back-pressure, so
// the agent's writes never wait, and the tunnel never sees the stall);
// the flows keep carrying datagrams meanwhile, and the download runs at
// about its speed alone. (The tunnel's own drops, of a flow whose reader
// falls behind, are the unit tests': tunnelcore's
// TestFlowStalledReaderDoesNotSlowConnections.)
func TestUDPStalledUpstreamDoesNotSlowTCP(t *testing.T) {
	stalled, err := net.ListenUDP("udp", &net.UDPAddr{IP: net.IPv4(127, 0, 0, 1)})
	if err != nil {
		t.Fatal(err)
	}
	defer stalled.Close() // never read
	const size = 256 << 20
	bulk := serveTCP(t, func(c net.Conn) { io.CopyN(c, zeroReader{}, size) })
	udpPort, tcpPort := freeUDPPort(t), freePort(t)
	global := udpNodeGlobal + udpPortRangeGlobal(udpPort, udpPort) + portRangeGlobal(tcpPort, tcpPort)
	c := startCaddyWith(t, caddyOptions{Global: global}, udpSites)
	startAgent(t, c.serverURL(), "agent-hol",
		agent.Upstream{Name: "stalled", ListenPort: udpPort, Target: udpTarget(stalled.LocalAddr().(*net.UDPAddr).Port)},
		agent.Upstream{Name: "bulk", ListenPort: tcpPort, Target: tcpTarget(bulk)})
	download := func() time.Duration {
		t.Helper()
		start := time.Now()
		conn, err := net.Dial("tcp", loopback(tcpPort))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		n, err := io.Copy(io.Discard, conn)
		if err != nil || n != size {
			t.Fatalf("download: %d bytes, %v", n, err)
		}
		return time.Since(start)
	}
	alone := download()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	for range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			floodUDP(t, udpPort, stop)
		}()
	}
	kernelDrops := udpRcvbufErrors(t)
	eventually(t, 10*time.Second, "the stalled upstream's socket to overflow", func() bool {
		return udpRcvbufErrors(t) > kernelDrops
	})
	carried := nodeMetric(scrapeMetrics(t, c), "sluice_udp_datagrams_total", "direction", "to_agent")
	flooded := download()
	close(stop)
	wg.Wait()
	text := scrapeMetrics(t, c)
	during := nodeMetric(text, "sluice_udp_datagrams_total", "direction", "to_agent") - carried
	t.Logf("256 MiB download: alone %v, beside 200 Mbit/s of datagrams to a stalled upstream %v; "+
		"datagrams carried meanwhile %v, dropped by the upstream's kernel so far %d, by the node %v",
		alone, flooded, during, udpRcvbufErrors(t)-kernelDrops, udpDrops(text))
	if during == 0 {
		t.Error("the flows carried nothing during the download")
	}
	if flooded > 3*alone+time.Second {
		t.Errorf("the download took %v beside the flood, %v alone", flooded, alone)
	}
}

// udpRcvbufErrors is the kernel's count of datagrams dropped for a full
// socket receive buffer (/proc/net/snmp, Udp: RcvbufErrors).
func udpRcvbufErrors(t testing.TB) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/net/snmp")
	if err != nil {
		t.Skipf("no /proc/net/snmp: %v", err)
	}
	var names []string
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || f[0] != "Udp:" {
			continue
		}
		if names == nil {
			names = f
			continue
		}
		if i := slices.Index(names, "RcvbufErrors"); i > 0 && i < len(f) {
			v, _ := strconv.ParseInt(f[i], 10, 64)
			return v
		}
	}
	t.Skip("no Udp: RcvbufErrors in /proc/net/snmp")
	return 0
}

// udpDrops sums the node's dropped datagrams, every reason.
func udpDrops(text string) float64 {
	return nodeMetric(text, "sluice_udp_datagrams_dropped_total")
}

// floodUDP sends 1400-byte datagrams to port at 100 Mbit/s (9 every
// millisecond, paced as a real sender would be) until stop.
func floodUDP(t testing.TB, port int, stop <-chan struct{}) {
	c := dialUDP(t, port)
	p := make([]byte, 1400)
	tick := time.NewTicker(time.Millisecond)
	defer tick.Stop()
	for {
		select {
		case <-stop:
			return
		case <-tick.C:
		}
		for range 9 {
			c.Write(p)
		}
	}
}

// zeroReader reads zeros.
type zeroReader struct{}

func (zeroReader) Read(p []byte) (int, error) {
	clear(p)
	return len(p), nil
}

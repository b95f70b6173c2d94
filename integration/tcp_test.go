package integration

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"crypto/tls"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/pires/go-proxyproto"

	"github.com/sluice-tunnel/sluice/agent"
)

// Raw TCP and TLS passthrough, full stack: real Caddy with the layer4 app or
// listener wrapper, real agents, real servers (redis-server, openssl
// s_server, Go servers) and real clients (redis-cli, curl, Go).

func TestRedisThroughListenPort(t *testing.T) {
	redis := startRedis(t)
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(port, port)}, "")
	startAgent(t, c.serverURL(), "agent-redis", agent.Upstream{ListenPort: port, Target: tcpTarget(redis)})
	cli := needCommand(t, "redis-cli")
	p := strconv.Itoa(port)

	t.Run("PING", func(t *testing.T) {
		out, err := runCmd(t, nil, cli, "-h", "127.0.0.1", "-p", p, "PING")
		if err != nil || strings.TrimSpace(out) != "PONG" {
			t.Fatalf("PING: %q %v", out, err)
		}
	})

	t.Run("SET and GET 1 MiB", func(t *testing.T) {
		raw := make([]byte, 512<<10)
		rand.Read(raw)
		value := hex.EncodeToString(raw) // 1 MiB, no newline
		out, err := runCmd(t, []byte(value), cli, "-h", "127.0.0.1", "-p", p, "-x", "SET", "big")
		if err != nil || strings.TrimSpace(out) != "OK" {
			t.Fatalf("SET: %q %v", out, err)
		}
		out, err = runCmd(t, nil, cli, "-h", "127.0.0.1", "-p", p, "GET", "big")
		if err != nil || strings.TrimSuffix(out, "\n") != value {
			t.Fatalf("GET: %d bytes (want %d), err %v", len(out), len(value)+1, err)
		}
		// The value really is in the upstream Redis.
		r, err := dialRESP(loopback(redis))
		if err != nil {
			t.Fatal(err)
		}
		defer r.Close()
		if v, err := r.do("STRLEN", "big"); err != nil || v != int64(len(value)) {
			t.Fatalf("STRLEN at the upstream: %v %v", v, err)
		}
	})

	t.Run("SUBSCRIBE receives later PUBLISHes", func(t *testing.T) {
		sub, err := dialRESP(loopback(port))
		if err != nil {
			t.Fatal(err)
		}
		defer sub.Close()
		v, err := sub.do("SUBSCRIBE", "news")
		if err != nil || fmt.Sprint(v) != "[subscribe news 1]" {
			t.Fatalf("SUBSCRIBE: %v %v", v, err)
		}
		for i := range 3 {
			// The subscriber's connection sits idle between messages.
			time.Sleep(300 * time.Millisecond)
			msg := fmt.Sprintf("message %d", i)
			out, err := runCmd(t, nil, cli, "-h", "127.0.0.1", "-p", p, "PUBLISH", "news", msg)
			if err != nil || strings.TrimSpace(out) != "1" {
				t.Fatalf("PUBLISH: %q %v (want 1 receiver)", out, err)
			}
			v, err := sub.readWithin(10 * time.Second)
			if err != nil || fmt.Sprint(v) != fmt.Sprintf("[message news %s]", msg) {
				t.Fatalf("subscriber got %v %v", v, err)
			}
		}
	})
}

// selfSignedCert makes a certificate for cn (and SAN dns) with openssl and
// returns the paths and the DER bytes.
func selfSignedCert(t *testing.T, openssl, cn, dns string) (certFile, keyFile string, der []byte) {
	t.Helper()
	dir := t.TempDir()
	certFile, keyFile = filepath.Join(dir, "cert.pem"), filepath.Join(dir, "key.pem")
	if out, err := exec.Command(openssl, "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
		"-nodes", "-keyout", keyFile, "-out", certFile, "-days", "1",
		"-subj", "/CN="+cn, "-addext", "subjectAltName=DNS:"+dns).CombinedOutput(); err != nil {
		t.Fatalf("openssl req: %v: %s", err, out)
	}
	b, err := os.ReadFile(certFile)
	if err != nil {
		t.Fatal(err)
	}
	blk, _ := pem.Decode(b)
	if blk == nil {
		t.Fatal("no PEM in the generated certificate")
	}
	return certFile, keyFile, blk.Bytes
}

// passthroughGlobal routes TLS for *.pass.test on the HTTPS port to sluice
// by SNI, before Caddy's own TLS.
const passthroughGlobal = `	servers 127.0.0.1:{HTTPS} {
		listener_wrappers {
			layer4 {
				@pass tls sni *.pass.test
				route @pass {
					sluice
				}
			}
			tls
		}
	}
`

// httpsGet GETs https://host:port/ with Caddy's HTTPS port as the address.
func httpsGet(c *caddyServer, host string) (int, string, *tls.ConnectionState, error) {
	client := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{
		TLSClientConfig: insecureTLS(host),
		DialContext: func(ctx context.Context, network, _ string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, network, loopback(c.httpsPort))
		},
	}}
	defer client.CloseIdleConnections()
	resp, err := client.Get(fmt.Sprintf("https://%s:%d/", host, c.httpsPort))
	if err != nil {
		return 0, "", nil, err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b), resp.TLS, nil
}

func TestTLSPassthroughBySNI(t *testing.T) {
	openssl := needCommand(t, "openssl")
	curl := needCommand(t, "curl")
	certFile, keyFile, der := selfSignedCert(t, openssl, "upstream.pass.test", "secure.pass.test")
	sPort := freePort(t)
	startProcess(t, openssl, "s_server", "-accept", loopback(sPort), "-cert", certFile, "-key", keyFile, "-www", "-quiet")
	eventually(t, 10*time.Second, "openssl s_server accepts TLS", func() bool {
		conn, err := tls.DialWithDialer(&net.Dialer{Timeout: time.Second}, "tcp", loopback(sPort), insecureTLS("secure.pass.test"))
		if err != nil {
			return false
		}
		conn.Close()
		return true
	})

	c := startCaddyWith(t, caddyOptions{Global: passthroughGlobal}, "app.test {\n\ttls internal\n\trespond \"caddy site\"\n}\n")
	startAgent(t, c.serverURL(), "agent-pass", agent.Upstream{Host: "secure.pass.test", Target: tcpTarget(sPort), TLSPassthrough: true})

	t.Run("curl reaches s_server by SNI", func(t *testing.T) {
		url := fmt.Sprintf("https://secure.pass.test:%d/", c.httpsPort)
		cmd := exec.Command(curl, "-sS", "-k", "-v", "--max-time", "20",
			"--resolve", fmt.Sprintf("secure.pass.test:%d:127.0.0.1", c.httpsPort), url)
		var stdout, stderr bytes.Buffer
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		if err := cmd.Run(); err != nil {
			t.Fatalf("curl: %v\n%s", err, stderr.String())
		}
		if !strings.Contains(stdout.String(), "s_server") {
			t.Fatalf("body is not s_server's page:\n%s", stdout.String())
		}
		if !strings.Contains(stderr.String(), "CN=upstream.pass.test") {
			t.Fatalf("curl did not see the upstream's certificate:\n%s", stderr.String())
		}
	})

	t.Run("the client sees the upstream's certificate", func(t *testing.T) {
		conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", loopback(c.httpsPort), insecureTLS("secure.pass.test"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		if got := conn.ConnectionState().PeerCertificates[0].Raw; !bytes.Equal(got, der) {
			t.Fatalf("peer certificate %q is not the upstream's", conn.ConnectionState().PeerCertificates[0].Subject)
		}
	})

	t.Run("Caddy's own site on the same port still works", func(t *testing.T) {
		if raceBuild() {
			// caddy-l4 v0.1.2's listener wrapper reads the counters of a
			// connection it handed on to the HTTP server (the "connection
			// stats" debug line in layer4/listener.go, after pipeConnection),
			// racing with the server's reads. Not ours to fix; the test runs
			// without -race.
			t.Skip("caddy-l4 listener wrapper races on fall-through connections under -race")
		}
		var (
			code int
			body string
			st   *tls.ConnectionState
			err  error
		)
		// Internal certificates are issued asynchronously at start.
		eventually(t, 20*time.Second, "app.test served over HTTPS", func() bool {
			code, body, st, err = httpsGet(c, "app.test")
			return err == nil
		})
		if code != 200 || body != "caddy site" {
			t.Fatalf("app.test: %d %q", code, body)
		}
		if bytes.Equal(st.PeerCertificates[0].Raw, der) {
			t.Fatal("app.test was answered with the passthrough upstream's certificate")
		}
	})
}

func TestRedisTLSTerminatedAtLayer4(t *testing.T) {
	redis := startRedis(t)
	cli := needCommand(t, "redis-cli")
	port := freePort(t)
	global := fmt.Sprintf(`	layer4 {
		127.0.0.1:%d {
			@r tls sni redis.tls.test
			route @r {
				tls
				sluice
			}
		}
	}
`, port)
	// The site makes Caddy manage an internal certificate for the name;
	// the layer4 tls handler uses it.
	c := startCaddyWith(t, caddyOptions{Global: global}, "redis.tls.test {\n\ttls internal\n\trespond \"x\"\n}\n")
	startAgent(t, c.serverURL(), "agent-redis", agent.Upstream{Host: "redis.tls.test", Target: tcpTarget(redis)})
	p := strconv.Itoa(port)

	// Verified against Caddy's internal root; --insecure first where
	// redis-cli has it (7.0+), as the certificate is issued asynchronously.
	root := filepath.Join(c.storage, "pki", "authorities", "local", "root.crt")
	tlsArgs := []string{"--tls", "--cacert", root, "--sni", "redis.tls.test", "-h", "127.0.0.1", "-p", p}
	pingArgs := tlsArgs
	if help, _ := exec.Command(cli, "--help").CombinedOutput(); bytes.Contains(help, []byte("--insecure")) {
		pingArgs = []string{"--tls", "--insecure", "--sni", "redis.tls.test", "-h", "127.0.0.1", "-p", p}
	}
	var out string
	var err error
	eventually(t, 20*time.Second, "redis-cli --tls PING answered", func() bool {
		out, err = runCmd(t, nil, cli, append(pingArgs, "PING")...)
		return err == nil && strings.TrimSpace(out) == "PONG"
	})

	// A 256 KiB value round trip.
	raw := make([]byte, 128<<10)
	rand.Read(raw)
	value := hex.EncodeToString(raw)
	if out, err = runCmd(t, []byte(value), cli, append(tlsArgs, "-x", "SET", "k")...); err != nil || strings.TrimSpace(out) != "OK" {
		t.Fatalf("SET: %q %v", out, err)
	}
	if out, err = runCmd(t, nil, cli, append(tlsArgs, "GET", "k")...); err != nil || strings.TrimSuffix(out, "\n") != value {
		t.Fatalf("GET: %d bytes, want %d; %v", len(out), len(value)+1, err)
	}

	// Another server name is not routed (the matcher does not match).
	conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 5 * time.Second}, "tcp", loopback(port), insecureTLS("other.tls.test"))
	if err == nil {
		conn.Close()
		t.Fatal("TLS to an unrouted server name succeeded")
	}
}

// proxyGlobal is a layer4 server on port that takes a PROXY header from
// loopback clients and relays to the route named route.
func proxyGlobal(port int, route string) string {
	return fmt.Sprintf(`	layer4 {
		127.0.0.1:%d {
			route {
				proxy_protocol {
					allow 127.0.0.1/32
				}
				sluice %s
			}
		}
	}
`, port, route)
}

// proxyHeader is an inbound PROXY header from 203.0.113.7:5555 to
// 127.0.0.1:port.
func proxyHeader(t testing.TB, version byte, port int) []byte {
	t.Helper()
	h := &proxyproto.Header{
		Version:           version,
		Command:           proxyproto.PROXY,
		TransportProtocol: proxyproto.TCPv4,
		SourceAddr:        &net.TCPAddr{IP: net.ParseIP("203.0.113.7"), Port: 5555},
		DestinationAddr:   &net.TCPAddr{IP: net.ParseIP("127.0.0.1"), Port: port},
	}
	b, err := h.Format()
	if err != nil {
		t.Fatal(err)
	}
	if version == 1 && string(b) != fmt.Sprintf("PROXY TCP4 203.0.113.7 127.0.0.1 5555 %d\r\n", port) {
		t.Fatalf("v1 header %q", b)
	}
	return b
}

func TestProxyProtocolInAndOut(t *testing.T) {
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: proxyGlobal(port, "echo")}, "")
	reports := make(chan proxyReport, 4)
	up := serveTCP(t, proxyEchoHandler(reports))

	for _, tc := range []struct {
		in       byte   // inbound header version
		out      string // agent's PROXY version to the upstream
		outMajor byte
	}{
		{1, "v1", 1},
		{1, "v2", 2},
		{2, "v1", 1},
	} {
		t.Run(fmt.Sprintf("in v%d out %s", tc.in, tc.out), func(t *testing.T) {
			// The same agent id each time: the new session replaces the last.
			startAgent(t, c.serverURL(), "agent-pp", agent.Upstream{Name: "echo", Target: tcpTarget(up), ProxyProtocol: tc.out})
			conn, err := net.DialTimeout("tcp", loopback(port), 5*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			defer conn.Close()
			payload := "payload after the header"
			conn.Write(append(proxyHeader(t, tc.in, port), payload...))
			conn.(*net.TCPConn).CloseWrite()
			got, err := readAllWithin(conn, 10*time.Second)
			if err != nil {
				t.Fatal(err)
			}
			want := fmt.Sprintf("203.0.113.7:5555 127.0.0.1:%d\n%s", port, payload)
			if string(got) != want {
				t.Fatalf("upstream answered %q, want %q", got, want)
			}
			select {
			case r := <-reports:
				if r.err != nil || r.version != tc.outMajor || r.src != "203.0.113.7:5555" {
					t.Fatalf("upstream saw %+v, want a v%d header from 203.0.113.7:5555", r, tc.outMajor)
				}
			case <-time.After(10 * time.Second):
				t.Fatal("upstream reported nothing")
			}
		})
	}
}

// TestProxyProtocolKeepsPortRouting: behind a load balancer that sends a
// PROXY header, a connection takes the listen-port route of the port Caddy
// accepted it on, not of the header's destination port (the balancer's own
// port, or another route's).
func TestProxyProtocolKeepsPortRouting(t *testing.T) {
	port, other := freePort(t), freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: proxyGlobal(port, "")}, "")
	upA, upB := serveTCP(t, greetEchoHandler("a")), serveTCP(t, greetEchoHandler("b"))
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(upA)})
	startAgent(t, c.serverURL(), "agent-b", agent.Upstream{ListenPort: other, Target: tcpTarget(upB)})
	greet := func(dstPort int) (string, error) {
		conn, err := net.DialTimeout("tcp", loopback(port), 5*time.Second)
		if err != nil {
			return "", err
		}
		defer conn.Close()
		conn.SetDeadline(time.Now().Add(5 * time.Second))
		if _, err := conn.Write(proxyHeader(t, 1, dstPort)); err != nil {
			return "", err
		}
		line, err := bufio.NewReader(conn).ReadString('\n')
		return strings.TrimSpace(line), err
	}
	eventually(t, 10*time.Second, "agent-a serving its port", func() bool { g, err := greet(port); return err == nil && g == "a" })
	for _, dst := range []int{443, other} {
		if g, err := greet(dst); err != nil || g != "a" {
			t.Errorf("PROXY destination port %d: upstream %q (%v), want agent-a's, the route of port %d", dst, g, err, port)
		}
	}
}

func TestPortClaims(t *testing.T) {
	port, other := freePort(t), freePort(t)
	lo, hi := min(port, other), max(port, other)
	addr := loopback(port)
	echo := serveTCP(t, echoHandler)

	// Only the other port is claimable at first.
	c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(other, other)}, "")
	a, logs := launchAgentObserved(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(echo)})
	waitConnected(t, a)
	sessions := a.Sessions()

	eventually(t, 5*time.Second, "the agent logs the rejection", func() bool {
		return logs.FilterMessage("route rejected by node").FilterField(zapUint32("listen_port", port)).Len() > 0
	})
	if conn, err := net.DialTimeout("tcp", addr, time.Second); err == nil {
		conn.Close()
		t.Fatalf("port %d is bound though outside tcp_port_range", port)
	}

	// A reload widening the range: the agent's re-advertise claims it.
	c.loadGlobal(portRangeGlobal(lo, hi), "")
	eventually(t, 10*time.Second, "traffic through the claimed port", func() bool { return echoWorks(addr) == nil })
	if got := a.Sessions(); got != sessions || a.State() != agent.StateConnected {
		t.Fatalf("agent reconnected: sessions %d -> %d, state %v", sessions, got, a.State())
	}
	eventually(t, 5*time.Second, "the agent logs the acceptance", func() bool {
		return logs.FilterMessage("route accepted after retry").Len() > 0
	})

	// A reload narrowing the range releases the port at once (a relayed
	// connection keeps running) and tells the agent, which stays connected.
	held, err := net.DialTimeout("tcp", addr, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	if err := echoWithin(held, "before", 5*time.Second); err != nil {
		t.Fatal(err)
	}
	rejections := logs.FilterMessage("route rejected by node").Len()
	c.loadGlobal(portRangeGlobal(other, other), "")
	eventually(t, 10*time.Second, "the port released after the range narrowed", func() bool { return portFree(addr) })
	eventually(t, 5*time.Second, "the agent logs the new rejection", func() bool {
		return logs.FilterMessage("route rejected by node").Len() > rejections
	})
	if err := echoWithin(held, "after", 5*time.Second); err != nil {
		t.Fatalf("a connection relayed before the reload: %v", err)
	}
	// Widened again: bound again without waiting for the agent's backoff.
	c.loadGlobal(portRangeGlobal(lo, hi), "")
	eventually(t, 5*time.Second, "traffic through the port again", func() bool { return echoWorks(addr) == nil })
	// A new tcp_bind moves the port to the new address.
	if ln, err := net.Listen("tcp6", "[::1]:0"); err == nil {
		ln.Close()
		c.loadGlobal(fmt.Sprintf("\tsluice {\n\t\ttcp_port_range %d-%d\n\t\ttcp_bind ::1\n\t}\n", lo, hi), "")
		eventually(t, 5*time.Second, "the port moved to [::1]", func() bool {
			return echoWorks(net.JoinHostPort("::1", strconv.Itoa(port))) == nil && portFree(addr)
		})
		c.loadGlobal(portRangeGlobal(lo, hi), "")
		eventually(t, 5*time.Second, "the port back on 127.0.0.1", func() bool { return echoWorks(addr) == nil })
	}
	if got := a.Sessions(); got != sessions || a.State() != agent.StateConnected {
		t.Fatalf("agent reconnected across the reloads: sessions %d -> %d, state %v", sessions, got, a.State())
	}

	// The agent leaving releases the port.
	a.stop()
	eventually(t, 10*time.Second, "the port released", func() bool { return portFree(addr) })

	// Two agents claim one port: the smaller id owns it, the other takes
	// over when it leaves.
	upA := serveTCP(t, greetEchoHandler("a"))
	upB := serveTCP(t, greetEchoHandler("b"))
	agentB := startAgent(t, c.serverURL(), "agent-b", agent.Upstream{ListenPort: port, Target: tcpTarget(upB)})
	if g, err := greeting(addr); err != nil || g != "b" {
		t.Fatalf("with agent-b alone: %q %v", g, err)
	}
	agentA := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(upA)})
	for i := range 5 {
		if g, err := greeting(addr); err != nil || g != "a" {
			t.Fatalf("connection %d with agent-a and agent-b: %q %v, want agent-a's upstream", i, g, err)
		}
	}
	agentA.stop()
	eventually(t, 10*time.Second, "agent-b serves again", func() bool {
		g, err := greeting(addr)
		return err == nil && g == "b"
	})

	// A larger id than the holder's is refused, and retried: it takes the
	// port once the holder leaves.
	upC := serveTCP(t, greetEchoHandler("c"))
	agentC, logsC := launchAgentObserved(t, c.serverURL(), "agent-c", agent.Upstream{ListenPort: port, Target: tcpTarget(upC)})
	waitConnected(t, agentC)
	eventually(t, 5*time.Second, "agent-c logs the refusal", func() bool {
		for _, e := range logsC.FilterMessage("route rejected by node").All() {
			if strings.Contains(e.ContextMap()["reason"].(string), "held by agent agent-b") {
				return true
			}
		}
		return false
	})
	if g, err := greeting(addr); err != nil || g != "b" {
		t.Fatalf("with agent-b holding the port: %q %v", g, err)
	}
	agentB.stop()
	eventually(t, 10*time.Second, "agent-c takes the port over", func() bool {
		g, err := greeting(addr)
		return err == nil && g == "c"
	})
}

// TestFailedReloadKeepsPortClaims: a reload that fails after the sluice
// app started (another app cannot bind its port) is rolled back, and so
// are its port options: once Caddy's load returns, the claimed port serves
// and the agent holds no rejection (it may have seen one come and go while
// the failed config was briefly started, as Caddy's own listeners do).
// Caddy starts apps in random order, so the failing reload is tried several
// times to cover sluice starting first.
func TestFailedReloadKeepsPortClaims(t *testing.T) {
	port, other := freePort(t), freePort(t)
	addr := loopback(port)
	echo := serveTCP(t, echoHandler)
	c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(port, port)}, "")
	a, logs := launchAgentObserved(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(echo)})
	waitConnected(t, a)
	eventually(t, 10*time.Second, "traffic through the claimed port", func() bool { return echoWorks(addr) == nil })

	busy, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	failing := fmt.Sprintf("http://127.0.0.1:%d {\n\tbind 127.0.0.1\n\trespond \"unreachable\"\n}", busy.Addr().(*net.TCPAddr).Port)
	// Caddy starts apps in map order: sluice starts before the failing
	// app (the rollback this test is about) in some attempts only.
	for i := range 24 {
		if err := c.tryLoadGlobal(portRangeGlobal(other, other), failing); err == nil {
			t.Fatalf("attempt %d: a config binding a busy port loaded", i)
		}
		if err := echoWorks(addr); err != nil {
			t.Fatalf("attempt %d: the claimed port stopped serving after a failed reload: %v", i, err)
		}
	}
	// One route's lines alternate, rejected then accepted: equal counts
	// (both read on each poll) mean no rejection stands.
	eventually(t, 5*time.Second, "every rejection withdrawn", func() bool {
		return logs.FilterMessage("route accepted after retry").Len() == logs.FilterMessage("route rejected by node").Len()
	})
	rejected := logs.FilterMessage("route rejected by node").Len()
	if rejected == 0 {
		t.Log("sluice never started before the failing app: the rollback path was not exercised")
	}
	if got := a.Sessions(); got != 1 || a.State() != agent.StateConnected {
		t.Fatalf("agent reconnected: sessions %d, state %v", got, a.State())
	}
}

// TestUnmatchedServerNameFallsBackToThePortRoute: a TLS connection whose
// server name no agent serves, on a layer4 port whose catch-all route is
// sluice, reaches the agent's listen-port route, also after a route whose
// tls matcher read the ClientHello and did not match (caddy-l4 records the
// name anyway).
func TestUnmatchedServerNameFallsBackToThePortRoute(t *testing.T) {
	port := freePort(t)
	global := fmt.Sprintf(`	layer4 {
		127.0.0.1:%d {
			@other tls sni other.test
			route @other {
				tls
			}
			route {
				sluice
			}
		}
	}
`, port)
	c := startCaddyWith(t, caddyOptions{Global: global}, "")
	web := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "port upstream")
	}))
	defer web.Close()
	startAgent(t, c.serverURL(), "agent-port", agent.Upstream{ListenPort: port, Target: tcpTarget(web.Listener.Addr().(*net.TCPAddr).Port)})

	cl := &http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{TLSClientConfig: insecureTLS("nomatch.test")}}
	defer cl.CloseIdleConnections()
	resp, err := cl.Get(fmt.Sprintf("https://%s/", loopback(port)))
	if err != nil {
		t.Fatalf("TLS with an unserved server name on the port: %v", err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || string(body) != "port upstream" {
		t.Fatalf("got %d %q, want the port route's upstream", resp.StatusCode, body)
	}
}

func TestTCPNoRouteClosesPromptly(t *testing.T) {
	noAgent, served := freePort(t), freePort(t)
	global := passthroughGlobal + fmt.Sprintf(`	layer4 {
		127.0.0.1:%d {
			route {
				sluice
			}
		}
		127.0.0.1:%d {
			route {
				sluice
			}
		}
	}
`, noAgent, served)
	// A site, so that the HTTPS port (and its listener wrapper) exists.
	c := startCaddyWith(t, caddyOptions{Global: global}, "app.test {\n\ttls internal\n\trespond \"caddy site\"\n}\n")
	echo := serveTCP(t, echoHandler)
	web := httptest.NewTLSServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		io.WriteString(w, "passthrough upstream")
	}))
	defer web.Close()
	webPort := web.Listener.Addr().(*net.TCPAddr).Port
	// With no tcp_port_range the node binds nothing: the layer4 server on
	// the port serves the listen-port route.
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{ListenPort: served, Target: tcpTarget(echo)},
		agent.Upstream{Host: "ok.pass.test", Target: tcpTarget(webPort), TLSPassthrough: true})

	check := func(t *testing.T) {
		t.Helper()
		if err := echoWorks(loopback(served)); err != nil {
			t.Fatalf("port route: %v", err)
		}
		code, body, _, err := httpsGet(c, "ok.pass.test")
		if err != nil || code != 200 || body != "passthrough upstream" {
			t.Fatalf("passthrough route: %d %q %v", code, body, err)
		}
	}
	check(t)

	t.Run("port with no agent", func(t *testing.T) {
		conn, err := net.DialTimeout("tcp", loopback(noAgent), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close()
		conn.Write([]byte("hello?"))
		expectClosedWithin(t, conn, 2*time.Second)
		check(t)
	})

	t.Run("unknown SNI", func(t *testing.T) {
		start := time.Now()
		conn, err := tls.DialWithDialer(&net.Dialer{Timeout: 10 * time.Second}, "tcp", loopback(c.httpsPort), insecureTLS("nobody.pass.test"))
		if err == nil {
			conn.Close()
			t.Fatal("TLS handshake for an unserved server name succeeded")
		}
		if d := time.Since(start); d > 2*time.Second {
			t.Fatalf("closed after %v, want within 2s (%v)", d, err)
		}
		t.Logf("handshake failed at once: %v", err)
		check(t)
	})
}

// halfCloseFirstHandler writes greeting and half-closes, then reads the
// client's data until EOF and reports its digest.
func halfCloseFirstHandler(greeting []byte, reports chan<- string) func(net.Conn) {
	return func(c net.Conn) {
		c.Write(greeting)
		c.(*net.TCPConn).CloseWrite()
		b, err := io.ReadAll(c)
		if err != nil {
			reports <- "error: " + err.Error()
			return
		}
		reports <- digest(b)
	}
}

func TestHalfCloseThroughTCP(t *testing.T) {
	count := serveTCP(t, countHandler)
	reports := make(chan string, 8)
	first := serveTCP(t, halfCloseFirstHandler([]byte("hello\n"), reports))
	pCount, pFirst := freePort(t), freePort(t)
	l4Count, l4First, ppCount, ppFirst := freePort(t), freePort(t), freePort(t), freePort(t)
	l4 := func(port int, route string, pp bool) string {
		s := fmt.Sprintf("\t\t127.0.0.1:%d {\n\t\t\troute {\n", port)
		if pp {
			s += "\t\t\t\tproxy_protocol {\n\t\t\t\t\tallow 127.0.0.1/32\n\t\t\t\t}\n"
		}
		return s + fmt.Sprintf("\t\t\t\tsluice %s\n\t\t\t}\n\t\t}\n", route)
	}
	global := portRangeGlobal(min(pCount, pFirst), max(pCount, pFirst)) + "\tlayer4 {\n" +
		l4(l4Count, "count.tcp.test", false) + l4(l4First, "first.tcp.test", false) +
		l4(ppCount, "count.tcp.test", true) + l4(ppFirst, "first.tcp.test", true) + "\t}\n"
	c := startCaddyWith(t, caddyOptions{Global: global}, "")
	startAgent(t, c.serverURL(), "agent-a",
		agent.Upstream{ListenPort: pCount, Target: tcpTarget(count)},
		agent.Upstream{ListenPort: pFirst, Target: tcpTarget(first)},
		agent.Upstream{Host: "count.tcp.test", Target: tcpTarget(count)},
		agent.Upstream{Host: "first.tcp.test", Target: tcpTarget(first)})

	data := make([]byte, 256<<10)
	rand.Read(data)
	dial := func(t *testing.T, port int, pp bool) *net.TCPConn {
		conn, err := net.DialTimeout("tcp", loopback(port), 5*time.Second)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { conn.Close() })
		if pp {
			conn.Write(proxyHeader(t, 1, port))
		}
		return conn.(*net.TCPConn)
	}
	for _, path := range []struct {
		name         string
		count, first int
		pp           bool
	}{
		{"listen-port route", pCount, pFirst, false},
		{"layer4 by route name", l4Count, l4First, false},
		{"layer4 after proxy_protocol", ppCount, ppFirst, true},
	} {
		t.Run(path.name+"/client half-closes", func(t *testing.T) {
			conn := dial(t, path.count, path.pp)
			if _, err := conn.Write(data); err != nil {
				t.Fatal(err)
			}
			if err := conn.CloseWrite(); err != nil {
				t.Fatal(err)
			}
			got, err := readAllWithin(conn, 10*time.Second)
			if err != nil || string(got) != digest(data)+"\n" {
				t.Fatalf("response %q, err %v; want %q", got, err, digest(data))
			}
		})
		t.Run(path.name+"/upstream half-closes", func(t *testing.T) {
			conn := dial(t, path.first, path.pp)
			conn.SetReadDeadline(time.Now().Add(10 * time.Second))
			greet := make([]byte, 6)
			if _, err := io.ReadFull(conn, greet); err != nil || string(greet) != "hello\n" {
				t.Fatalf("greeting %q: %v", greet, err)
			}
			// The upstream's half-close reaches the client as EOF...
			if n, err := conn.Read(make([]byte, 1)); n != 0 || err != io.EOF {
				t.Fatalf("after the greeting: %d bytes, %v; want EOF", n, err)
			}
			// ...and the client can still send.
			if _, err := conn.Write(data); err != nil {
				t.Fatalf("write after the upstream's half-close: %v", err)
			}
			conn.CloseWrite()
			select {
			case r := <-reports:
				if r != digest(data) {
					t.Fatalf("upstream received %s, want %s", r, digest(data))
				}
			case <-time.After(10 * time.Second):
				t.Fatal("upstream reported nothing")
			}
		})
	}
}

func TestTCPThousandConcurrentConnections(t *testing.T) {
	const n = 1000
	raiseNoFile(t, 5*n+1000) // client, node, agent and upstream ends, plus slack
	echo := serveTCP(t, echoHandler)
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(port, port)}, "")
	a := startAgent(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(echo)})

	deadline := time.Now().Add(60 * time.Second)
	conns := make([]net.Conn, n)
	defer func() {
		for _, conn := range conns {
			if conn != nil {
				conn.Close()
			}
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, n)
	// All connections open at once...
	for i := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			conn, err := net.DialTimeout("tcp", loopback(port), time.Until(deadline))
			if err != nil {
				errs <- fmt.Errorf("dial %d: %w", i, err)
				return
			}
			conn.SetDeadline(deadline)
			conns[i] = conn
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	eventually(t, time.Until(deadline), fmt.Sprintf("%d connections relayed by the agent", n), func() bool { return a.ActiveConns() == n })
	// ...then each does an echo exchange.
	errs = make(chan error, n)
	start := time.Now()
	for i, conn := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			msg := bytes.Repeat([]byte(fmt.Sprintf("connection %04d ", i)), 256) // 4 KiB
			if _, err := conn.Write(msg); err != nil {
				errs <- fmt.Errorf("write %d: %w", i, err)
				return
			}
			conn.(*net.TCPConn).CloseWrite()
			got, err := io.ReadAll(conn)
			if err != nil || !bytes.Equal(got, msg) {
				errs <- fmt.Errorf("connection %d: echoed %d of %d bytes, %v", i, len(got), len(msg), err)
			}
		}()
	}
	wg.Wait()
	close(errs)
	failed := 0
	for err := range errs {
		if failed++; failed <= 5 {
			t.Error(err)
		}
	}
	if failed > 0 {
		t.Fatalf("%d of %d connections failed", failed, n)
	}
	t.Logf("%d concurrent echo exchanges in %v", n, time.Since(start).Round(time.Millisecond))
	for _, conn := range conns {
		conn.Close()
	}
	eventually(t, 10*time.Second, "the agent's connections ended", func() bool { return a.ActiveConns() == 0 })
}

func TestVerbatimIdleTimeout(t *testing.T) {
	echo := serveTCP(t, echoHandler)
	port := freePort(t)
	c := startCaddyWith(t, caddyOptions{Global: portRangeGlobal(port, port)}, "")
	startAgent(t, c.serverURL(), "agent-a", agent.Upstream{ListenPort: port, Target: tcpTarget(echo), VerbatimIdleTimeout: time.Second})

	idle, err := net.DialTimeout("tcp", loopback(port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer idle.Close()
	busy, err := net.DialTimeout("tcp", loopback(port), 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer busy.Close()
	if err := echoWithin(idle, "first", 5*time.Second); err != nil {
		t.Fatal(err)
	}

	busyErr := make(chan error, 1)
	go func() {
		// 2 s of exchanges 100 ms apart, twice the timeout: a late wake-up
		// or a slow round trip on a loaded machine stays well inside it.
		for i := range 20 {
			if err := echoWithin(busy, fmt.Sprintf("tick %d", i), 5*time.Second); err != nil {
				busyErr <- fmt.Errorf("tick %d: %w", i, err)
				return
			}
			time.Sleep(100 * time.Millisecond)
		}
		busyErr <- echoWithin(busy, "last", 5*time.Second)
	}()

	start := time.Now()
	expectClosedWithin(t, idle, 5*time.Second)
	if d := time.Since(start); d < 800*time.Millisecond {
		t.Fatalf("idle connection closed after %v, before the 1s timeout", d)
	}
	if err := <-busyErr; err != nil {
		t.Fatalf("busy connection: %v", err)
	}
}

// TestProxyProtocolHTTPConnectionsArePerClient: on a host route whose
// agent upstream takes a PROXY header (a tcp:// target Caddy speaks HTTP
// to), the header is written once per connection and names one client, so
// the node pools those connections per client: interleaved keep-alive
// requests of two clients each reach the upstream under their own address,
// with the address the client reached as the destination.
func TestProxyProtocolHTTPConnectionsArePerClient(t *testing.T) {
	c := startCaddy(t, siteAll)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		// Behind proxyproto.Listener, the PROXY header's source and destination.
		fmt.Fprintf(w, "%s %s", r.RemoteAddr, r.Context().Value(http.LocalAddrContextKey))
	})}
	go srv.Serve(&proxyproto.Listener{Listener: ln})
	defer srv.Close()
	startAgent(t, c.serverURL(), "agent-pp", agent.Upstream{Host: "app.test", Target: "tcp://" + ln.Addr().String(), ProxyProtocol: "v1"})

	// client is one keep-alive client connection to Caddy; addr is its
	// local address once it dialed.
	type client struct {
		http *http.Client
		addr string
	}
	newClient := func() *client {
		cl := &client{}
		tr := &http.Transport{MaxConnsPerHost: 1, DialContext: func(ctx context.Context, network, addr string) (net.Conn, error) {
			conn, err := (&net.Dialer{}).DialContext(ctx, network, addr)
			if err == nil {
				if cl.addr != "" {
					t.Errorf("client %s dialed a second connection", cl.addr)
				}
				cl.addr = conn.LocalAddr().String()
			}
			return conn, err
		}}
		cl.http = &http.Client{Transport: tr, Timeout: 10 * time.Second}
		t.Cleanup(tr.CloseIdleConnections)
		return cl
	}
	want := fmt.Sprintf("127.0.0.1:%d", c.httpPort)
	a, b := newClient(), newClient()
	for i, cl := range []*client{a, b, a, b, a} {
		req, _ := http.NewRequest("GET", c.url("/"), nil)
		req.Host = "app.test"
		resp, err := cl.http.Do(req)
		if err != nil {
			t.Fatalf("request %d: %v", i, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if string(body) != cl.addr+" "+want {
			t.Fatalf("request %d from %s: the upstream saw %q, want %q", i, cl.addr, body, cl.addr+" "+want)
		}
	}
}

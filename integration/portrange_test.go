package integration

import (
	"fmt"
	"net"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
)

// TestPortRangeLists: tcp_port_range and udp_port_range take lists. A
// port in the second piece of the list is claimable (bound, and traffic
// reaches the agent's upstream); a port outside every piece is refused
// (reported to the agent, never bound). The TCP list is written with
// commas, the UDP one as several arguments.
func TestPortRangeLists(t *testing.T) {
	tcpFirst, tcpIn, tcpOut := freePort(t), freePort(t), freePort(t)
	udpFirst, udpIn, udpOut := freeUDPPort(t), freeUDPPort(t), freeUDPPort(t)
	sluiceOpts := fmt.Sprintf("\t\ttcp_port_range %d-%d,%d\n\t\ttcp_bind 127.0.0.1\n\t\tudp_port_range %d %d\n\t\tudp_bind 127.0.0.1\n",
		tcpFirst, tcpFirst, tcpIn, udpFirst, udpIn)
	c := startCaddyWith(t, caddyOptions{Sluice: sluiceOpts}, "")
	echo := serveTCP(t, echoHandler)
	udpEcho := serveUDPEcho(t, "echo:")
	a, logs := launchAgentObserved(t, c.serverURL(), "agent-lists",
		agent.Upstream{ListenPort: tcpIn, Target: tcpTarget(echo)},
		agent.Upstream{ListenPort: tcpOut, Target: tcpTarget(echo)},
		agent.Upstream{Name: "udp-in", ListenPort: udpIn, Target: udpTarget(udpEcho.port)},
		agent.Upstream{Name: "udp-out", ListenPort: udpOut, Target: udpTarget(udpEcho.port)})
	waitConnected(t, a)

	t.Run("tcp port in the second piece", func(t *testing.T) {
		eventually(t, 10*time.Second, "traffic through the claimed TCP port", func() bool { return echoWorks(loopback(tcpIn)) == nil })
	})
	t.Run("udp port in the second piece", func(t *testing.T) {
		client := dialUDP(t, udpIn)
		got, err := udpAsk(client, []byte("ping"), 20, 500*time.Millisecond)
		if err != nil || string(got) != "echo:ping" {
			t.Fatalf("through the claimed UDP port: %q, %v", got, err)
		}
	})
	t.Run("ports outside the lists", func(t *testing.T) {
		for _, p := range []int{tcpOut, udpOut} {
			eventually(t, 10*time.Second, fmt.Sprintf("the agent logs port %d rejected", p), func() bool {
				return logs.FilterMessage("route rejected by node").FilterField(zapUint32("listen_port", p)).Len() > 0
			})
		}
		if conn, err := net.DialTimeout("tcp", loopback(tcpOut), time.Second); err == nil {
			conn.Close()
			t.Fatalf("TCP port %d is bound though outside tcp_port_range", tcpOut)
		}
		pc, err := net.ListenPacket("udp", loopback(udpOut))
		if err != nil {
			t.Fatalf("UDP port %d is bound though outside udp_port_range: %v", udpOut, err)
		}
		pc.Close()
	})
}

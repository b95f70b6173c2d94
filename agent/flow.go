package agent

import (
	"context"
	"fmt"
	"net"

	"github.com/prometheus/client_golang/prometheus"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// Datagram flows (proto/README §6.1): the node opens one per client
// address of a udp:// route, and the agent gives each a UDP socket of its
// own, connected to the target, so that the upstream's replies on that
// socket go back to that client alone. The flow ends after the route's
// idle timeout (udp_idle_timeout, the node's or this end's, whichever
// notices first) or with the session, and its socket closes with it.

// udpSocketBuffer is the receive and send buffer asked of a flow's socket
// (the kernel caps it at net.core.rmem_max / wmem_max): an upstream's
// burst of replies waits there for the relay instead of being dropped.
// The kernel takes memory for what is queued, not for the size asked.
const udpSocketBuffer = 1 << 20

// handleFlow dials a socket for flow conn to up's target and relays
// datagrams until the flow ends; rep gets how it ended.
func (c *connector) handleFlow(ctx context.Context, conn *tunnelcore.Conn, up *upstream, rep *ConnReport) {
	d := net.Dialer{Timeout: c.dialTimeout}
	uc, err := d.DialContext(ctx, "udp", up.hostport) // no handshake: resolves the name, picks a port
	if err != nil {
		rep.Outcome, rep.Err = c.dialError(ctx, conn, up, err)
		return
	}
	if sock, ok := uc.(*net.UDPConn); ok {
		sock.SetReadBuffer(udpSocketBuffer)
		sock.SetWriteBuffer(udpSocketBuffer)
	}
	conn.SetIdleTimeout(up.cfg.UDPIdleTimeout) // 0: the session's default, 60 s
	res := tunnelcore.RelayDatagrams(conn, uc, 0)
	rep.FromClient, rep.ToClient, rep.Err = res.AToB, res.BToA, res.Err
	if res.Err != nil {
		rep.Outcome = ConnReset
	}
	st := conn.FlowStats()
	c.log.Debug("flow relayed",
		zap.String("route", up.cfg.Name), zap.Uint64("conn_id", conn.ID()), zap.String("remote_addr", rep.ClientAddr),
		zap.Int64("to_upstream", res.AToB), zap.Int64("from_upstream", res.BToA), zap.Bool("idle", st.Idle),
		zap.Int64("dropped_send_queue", st.DroppedSendQueue), zap.Int64("dropped_receive_queue", st.DroppedRecvQueue),
		zap.NamedError("relay_error", res.Err))
}

// mismatchMessage is the refusal of a connection whose kind its route
// does not take.
func mismatchMessage(route string, datagram bool) string {
	if datagram {
		return fmt.Sprintf("route %s takes no datagram flows (its target is not udp://)", route)
	}
	return fmt.Sprintf("route %s takes datagram flows only (its target is udp://)", route)
}

// The agent's metrics of datagram flows, read at scrape time from the
// sessions' tunnelcore counters (Agent.tunnel).
var (
	descFlowsActive = prometheus.NewDesc("sluice_udp_flows_active",
		"Datagram flows open (one per client address of a udp:// route, each with its own upstream socket).", nil, nil)
	descFlowsIdle = prometheus.NewDesc("sluice_udp_flows_idle_total",
		"Datagram flows the agent ended for their idle timeout (udp_idle_timeout).", nil, nil)
	descDatagrams = prometheus.NewDesc("sluice_udp_datagrams_total",
		"Datagrams carried, by direction (from_client: towards the upstream).", []string{"direction"}, nil)
	descDatagramBytes = prometheus.NewDesc("sluice_udp_bytes_total",
		"Datagram payload bytes carried, by direction (from_client: towards the upstream).", []string{"direction"}, nil)
	descDatagramsDropped = prometheus.NewDesc("sluice_udp_datagrams_dropped_total",
		"Datagrams dropped, by reason: a flow's send queue full (towards the node), its receive queue full (the upstream socket's writer behind), too large.", []string{"reason"}, nil)
)

func describeFlows(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descFlowsActive, descFlowsIdle, descDatagrams, descDatagramBytes, descDatagramsDropped} {
		ch <- d
	}
}

// collectFlows sends the flows' metrics of f.
func collectFlows(f *tunnelcore.FlowCounters, gauge func(*prometheus.Desc, float64, ...string), counter func(*prometheus.Desc, int64, ...string)) {
	gauge(descFlowsActive, float64(f.Active.Load()))
	counter(descFlowsIdle, f.IdleEnded.Load())
	counter(descDatagrams, f.DatagramsReceived.Load(), "from_client")
	counter(descDatagrams, f.DatagramsSent.Load(), "to_client")
	counter(descDatagramBytes, f.BytesReceived.Load(), "from_client")
	counter(descDatagramBytes, f.BytesSent.Load(), "to_client")
	counter(descDatagramsDropped, f.DroppedSendQueue.Load(), "send_queue_full")
	counter(descDatagramsDropped, f.DroppedRecvQueue.Load(), "receive_queue_full")
	counter(descDatagramsDropped, f.DroppedTooLarge.Load(), "too_large")
}

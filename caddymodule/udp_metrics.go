package caddymodule

import (
	"github.com/prometheus/client_golang/prometheus"
)

// udpMetrics are the node's metrics of datagram flows, read at scrape
// time from the sessions' tunnelcore counters (Counters.Flows) and the
// node's refusals: the data path only does the atomic adds tunnelcore
// does per datagram.
type udpMetrics struct {
	flowsActive, flowsTotal, flowsIdle *prometheus.Desc
	datagrams, bytes, dropped          *prometheus.Desc
	portClaims                         *prometheus.Desc
}

// flowDropReasons are the reasons of the drops the flows count themselves
// (tunnelcore.FlowCounters), beside the node's refusals (udpRefusalNames).
var flowDropReasons = [...]string{"send_queue_full", "receive_queue_full", "too_large"}

func newUDPMetrics(d func(name, help string, labels ...string) *prometheus.Desc) udpMetrics {
	return udpMetrics{
		flowsActive: d("sluice_udp_flows_active", "Datagram flows open (one per client address and UDP route)."),
		flowsTotal:  d("sluice_udp_flows_total", "Datagram flows opened."),
		flowsIdle:   d("sluice_udp_flows_idle_total", "Datagram flows this node ended for their idle timeout."),
		datagrams:   d("sluice_udp_datagrams_total", "Datagrams carried, by direction (to_agent, to_client).", "direction"),
		bytes:       d("sluice_udp_bytes_total", "Datagram payload bytes carried, by direction (to_agent, to_client).", "direction"),
		dropped: d("sluice_udp_datagrams_dropped_total", "Datagrams dropped, by reason: a flow's send or receive queue full, "+
			"too large, or its client refused before a flow opened (no route, allowed_cidrs, a limit).", "reason"),
		portClaims: d("sluice_udp_port_claims", "Claimed UDP ports: bound (one owner each) and standby claims.", "state"),
	}
}

func (m *udpMetrics) describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{m.flowsActive, m.flowsTotal, m.flowsIdle, m.datagrams, m.bytes, m.dropped, m.portClaims} {
		ch <- d
	}
}

// collect reports n's flows.
func (m *udpMetrics) collect(e emitter, n *node) {
	f := &n.metrics.tunnel.Flows
	e.gauge(m.flowsActive, float64(f.Active.Load()))
	e.counter(m.flowsTotal, float64(f.Opened.Load()))
	e.counter(m.flowsIdle, float64(f.IdleEnded.Load()))
	e.counter(m.datagrams, float64(f.DatagramsSent.Load()), "to_agent")
	e.counter(m.datagrams, float64(f.DatagramsReceived.Load()), "to_client")
	e.counter(m.bytes, float64(f.BytesSent.Load()), "to_agent")
	e.counter(m.bytes, float64(f.BytesReceived.Load()), "to_client")
	for i, v := range []int64{f.DroppedSendQueue.Load(), f.DroppedRecvQueue.Load(), f.DroppedTooLarge.Load()} {
		e.counter(m.dropped, float64(v), flowDropReasons[i])
	}
	for i, name := range udpRefusalNames {
		e.counter(m.dropped, float64(n.udp.refused[i].Load()), name)
	}
	bound, standby := n.udp.ports.claimCounts()
	e.gauge(m.portClaims, float64(bound), "bound")
	e.gauge(m.portClaims, float64(standby), "standby")
}

package tunnelcore

import (
	"io"
	"testing"
	"time"
)

// TestFlowIdleTimeoutEndsFlow: a flow that carries nothing for its idle
// timeout ends on the end whose timer it is (Close: the peer reads
// io.EOF), and is counted as idle; the other end's default timeout is
// far off.
func TestFlowIdleTimeoutEndsFlow(t *testing.T) {
	for _, side := range []string{"node", "agent"} {
		t.Run(side, func(t *testing.T) {
			var nodeCounts, agentCounts Counters
			_, _, nf, af := flowPair(t, transports[1], Config{Counters: &nodeCounts}, Config{Counters: &agentCounts})
			timed, other, counts := nf, af, &nodeCounts
			if side == "agent" {
				timed, other, counts = af, nf, &agentCounts
			}
			if counts.Flows.Active.Load() != 1 {
				t.Fatalf("active %d, want 1", counts.Flows.Active.Load())
			}
			start := time.Now()
			if err := timed.SetIdleTimeout(200 * time.Millisecond); err != nil {
				t.Fatal(err)
			}
			if _, err := other.ReadDatagram(make([]byte, 10)); err != io.EOF {
				t.Fatalf("the peer's read: %v, want io.EOF once the flow idled", err)
			}
			if took := time.Since(start); took < 150*time.Millisecond {
				t.Errorf("ended after %v, before its idle timeout", took)
			}
			if !timed.FlowStats().Idle || counts.Flows.IdleEnded.Load() != 1 {
				t.Errorf("stats %+v, idle ended %d", timed.FlowStats(), counts.Flows.IdleEnded.Load())
			}
			eventually(t, 5*time.Second, "both ends to count no active flow", func() bool {
				return nodeCounts.Flows.Active.Load() == 0 && agentCounts.Flows.Active.Load() == 0
			})
		})
	}
}

// TestFlowTrafficKeepsItOpen: datagrams either way hold the idle timeout
// off; once they stop, the flow ends a timeout later. The session's
// default (Config.FlowIdleTimeout) applies to a flow that sets none.
func TestFlowTrafficKeepsItOpen(t *testing.T) {
	const idle = 300 * time.Millisecond
	_, _, nf, af := flowPair(t, transports[0], Config{FlowIdleTimeout: idle}, Config{FlowIdleTimeout: time.Hour})
	buf := make([]byte, 10)
	until := time.Now().Add(3 * idle)
	for i := 0; time.Now().Before(until); i++ {
		w, r := nf, af // the node's timer sees both directions
		if i%2 == 1 {
			w, r = af, nf
		}
		if err := w.WriteDatagram([]byte("tick")); err != nil {
			t.Fatalf("after %d datagrams: %v", i, err)
		}
		if _, err := r.ReadDatagram(buf); err != nil {
			t.Fatalf("after %d datagrams: %v", i, err)
		}
		time.Sleep(idle / 6) // the traffic's pace, well inside the timeout
	}
	if nf.FlowStats().Idle {
		t.Fatal("the flow idled while it carried datagrams")
	}
	if _, err := af.ReadDatagram(buf); err != io.EOF {
		t.Fatalf("read once the traffic stopped: %v, want io.EOF", err)
	}
	if !nf.FlowStats().Idle {
		t.Error("the flow ended, but not for its idle timeout")
	}
}

// TestFlowIdleTimeoutOff: a negative timeout turns it off, and a later
// positive one arms it again.
func TestFlowIdleTimeoutOff(t *testing.T) {
	_, _, nf, af := flowPair(t, transports[0], Config{FlowIdleTimeout: 50 * time.Millisecond}, Config{FlowIdleTimeout: time.Hour})
	if err := nf.SetIdleTimeout(-1); err != nil {
		t.Fatal(err)
	}
	af.SetReadDeadline(time.Now().Add(300 * time.Millisecond))
	if _, err := af.ReadDatagram(make([]byte, 10)); !isTimeout(err) {
		t.Fatalf("read: %v; want the deadline, the flow never idling", err)
	}
	af.SetReadDeadline(time.Time{})
	nf.SetIdleTimeout(50 * time.Millisecond)
	if _, err := af.ReadDatagram(make([]byte, 10)); err != io.EOF {
		t.Fatalf("read: %v, want io.EOF once the timeout is back", err)
	}
}

func isTimeout(err error) bool {
	te, ok := err.(interface{ Timeout() bool })
	return ok && te.Timeout()
}

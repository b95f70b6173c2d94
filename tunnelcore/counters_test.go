package tunnelcore

import (
	"bytes"
	"io"
	"testing"
)

// TestCountersCountFlowControl: a transfer past the initial window makes
// the writer wait for credit and the reader grant it, and the Counters of
// each end count what that end did.
func TestCountersCountFlowControl(t *testing.T) {
	forEachTransport(t, func(t *testing.T, tr transport) {
		var nodeCounts, agentCounts Counters
		node, agent := sessionPair(t, tr, Config{Counters: &nodeCounts}, Config{Counters: &agentCounts})
		nc, err := node.Open(ConnectInfo{RouteKey: "r"})
		if err != nil {
			t.Fatal(err)
		}
		defer nc.Close()
		ac, err := agent.Accept(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		defer ac.Close()
		payload := bytes.Repeat([]byte("x"), 8*InitialWindow)
		done := make(chan error, 1)
		go func() {
			_, err := nc.Write(payload)
			if err == nil {
				err = nc.CloseWrite()
			}
			done <- err
		}()
		got, err := io.ReadAll(ac)
		if err != nil || len(got) != len(payload) {
			t.Fatalf("read %d bytes, %v; want %d", len(got), err, len(payload))
		}
		if err := <-done; err != nil {
			t.Fatal(err)
		}
		if nodeCounts.CreditWaits.Load() == 0 {
			t.Error("the writer sent 8 windows and never waited for credit")
		}
		if agentCounts.WindowUpdatesSent.Load() == 0 || nodeCounts.WindowUpdatesReceived.Load() == 0 {
			t.Errorf("grants sent by the reader %d, received by the writer %d; want both > 0",
				agentCounts.WindowUpdatesSent.Load(), nodeCounts.WindowUpdatesReceived.Load())
		}
	})
}

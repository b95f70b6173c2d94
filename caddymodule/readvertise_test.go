package caddymodule

import (
	"fmt"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestRepeatedAdvertisesArePaced: an agent that sends Advertises without
// pause gets the first admitted at once and, of those that follow within
// readvertiseEvery, only the latest, when its turn comes: one re-admission
// (and one ack) per interval, whatever the agent sends.
func TestRepeatedAdvertisesArePaced(t *testing.T) {
	n := testNode(t)
	nodeEnd, agentEnd := tunnelcore.Pipe(64)
	sess, err := tunnelcore.NewSession(nodeEnd, tunnelcore.Config{Role: tunnelcore.RoleNode})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { sess.Close() })
	acks := make(chan *tunnelpb.AdvertiseAck, 64)
	peer, err := tunnelcore.NewSession(agentEnd, tunnelcore.Config{Role: tunnelcore.RoleAgent, OnControl: func(f *tunnelpb.Frame) {
		if ack := f.GetAdvertiseAck(); ack != nil {
			acks <- ack
		}
	}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { peer.Close() })

	routes := func(host string) []*tunnelpb.Route {
		return []*tunnelpb.Route{{Name: host, Host: host, Target: "http://127.0.0.1:9"}}
	}
	a := &agentSession{agentID: "agent-a", sess: sess}
	n.admitMu.Lock()
	entries, _ := n.admit(a, routes("first.test"), nil)
	n.reg.register(a, entries)
	n.admitMu.Unlock()

	start := time.Now()
	const sent = 50
	for i := range sent {
		n.readvertise(a, routes(fmt.Sprintf("h%d.test", i)))
	}
	next := func() (string, time.Duration) {
		t.Helper()
		select {
		case ack := <-acks:
			if len(ack.GetAccepted()) != 1 {
				t.Fatalf("ack %v: want one route", ack)
			}
			return ack.GetAccepted()[0].GetName(), time.Since(start)
		case <-time.After(10 * time.Second):
			t.Fatal("no ack")
			return "", 0
		}
	}
	if name, _ := next(); name != "h0.test" {
		t.Fatalf("first ack lists %s, want h0.test (admitted at once)", name)
	}
	name, after := next()
	if name != fmt.Sprintf("h%d.test", sent-1) {
		t.Fatalf("second ack lists %s, want the latest Advertise's route (the ones between skipped)", name)
	}
	if after < readvertiseEvery {
		t.Fatalf("the latest Advertise was admitted %v after the first, within readvertiseEvery (%v)", after, readvertiseEvery)
	}
	if got := n.reg.table.Load().lookupHTTP(name); len(got) != 1 || got[0].agent != a {
		t.Fatalf("the registry serves %s with %v, want the agent", name, got)
	}
}

package agent

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// What an extra idle link costs the agent: BenchmarkIdleLinkCost runs an
// agent against one node without membership, then one against a cluster
// of costNodes nodes whose membership names them all, and reports the
// difference per extra link in goroutines, heap and goroutine stacks. The
// nodes run in a child process (TestHelperFakeNodes), so that the figures
// are the agent's alone. Run it with
//
//	go test ./agent/ -run '^$' -bench IdleLinkCost -benchtime 1x

// costNodes is the cluster's size in BenchmarkIdleLinkCost.
const costNodes = 17

// envFakeNodes makes TestHelperFakeNodes serve that many cluster nodes.
const envFakeNodes = "SLUICE_TEST_FAKE_NODES"

// TestHelperFakeNodes is the child process of BenchmarkIdleLinkCost: it
// serves one node without membership ("solo"), then $SLUICE_TEST_FAKE_NODES
// nodes that send a membership naming all of them, prints their addresses,
// and serves until its standard input closes.
func TestHelperFakeNodes(t *testing.T) {
	n, err := strconv.Atoi(os.Getenv(envFakeNodes))
	if err != nil {
		t.Skip("the child process of BenchmarkIdleLinkCost")
	}
	solo := newFakeNode(t, "secret", nodeOptions{id: "solo"})
	fmt.Printf("solo %s\n", solo.addr)
	var members atomic.Pointer[[]*tunnelpb.Node] // complete before any agent connects
	membership := func() *tunnelpb.MembershipUpdate { return &tunnelpb.MembershipUpdate{Nodes: *members.Load()} }
	var list []*tunnelpb.Node
	var first *fakeNode
	for i := range n {
		node := newFakeNode(t, "secret", nodeOptions{id: fmt.Sprintf("node-%02d", i), membership: membership})
		list = append(list, memberOf(node))
		if first == nil {
			first = node
		}
	}
	members.Store(&list)
	fmt.Printf("cluster %s\n", first.addr)
	io.Copy(io.Discard, os.Stdin) // until the parent closes it
}

// footprint is what the process holds at a moment, after a collection.
type footprint struct {
	goroutines int
	heap       int64 // live heap objects, bytes
	stacks     int64 // goroutine stacks, bytes
}

func measure() footprint {
	runtime.GC()
	runtime.GC() // a second cycle frees what the first one's finalizers released
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	return footprint{goroutines: runtime.NumGoroutine(), heap: int64(ms.HeapAlloc), stacks: int64(ms.StackInuse)}
}

// startFakeNodes starts the child process and returns the solo node's
// address and the cluster's first node's.
func startFakeNodes(b *testing.B) (solo, cluster string) {
	b.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^TestHelperFakeNodes$", "-test.count=1")
	cmd.Env = append(os.Environ(), fmt.Sprintf("%s=%d", envFakeNodes, costNodes))
	stdin, err := cmd.StdinPipe()
	if err != nil {
		b.Fatal(err)
	}
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		b.Fatal(err)
	}
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		stdin.Close()
		done := make(chan error, 1)
		go func() { done <- cmd.Wait() }()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
	})
	sc := bufio.NewScanner(stdout)
	for lines := 0; lines < 100 && (solo == "" || cluster == "") && sc.Scan(); lines++ {
		switch f := strings.Fields(sc.Text()); {
		case len(f) == 2 && f[0] == "solo":
			solo = f[1]
		case len(f) == 2 && f[0] == "cluster":
			cluster = f[1]
		}
	}
	if solo == "" || cluster == "" {
		b.Fatal("the child process named no nodes")
	}
	go io.Copy(io.Discard, stdout) // the rest of its output (PASS)
	return solo, cluster
}

// agentFootprint runs an agent with server addr until it has links
// connected links, and returns what it added to the process.
func agentFootprint(b *testing.B, addr string, links int) footprint {
	b.Helper()
	before := measure()
	a, err := New(testConfig(addr, "secret", Upstream{Name: "web", Target: "http://127.0.0.1:1"}), nil)
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- a.Run(ctx) }()
	defer func() {
		cancel()
		<-done
	}()
	waitFor(b, 20*time.Second, fmt.Sprintf("%d links connected", links), func() bool {
		n := 0
		for _, l := range a.Links() {
			if l.State == StateConnected {
				n++
			}
		}
		return n == links
	})
	after := measure()
	return footprint{goroutines: after.goroutines - before.goroutines,
		heap: after.heap - before.heap, stacks: after.stacks - before.stacks}
}

func BenchmarkIdleLinkCost(b *testing.B) {
	solo, cluster := startFakeNodes(b)
	for b.Loop() {
		one := agentFootprint(b, solo, 1)
		all := agentFootprint(b, cluster, costNodes)
		extra := float64(costNodes - 1)
		goroutines := float64(all.goroutines-one.goroutines) / extra
		heap := float64(all.heap-one.heap) / extra
		stacks := float64(all.stacks-one.stacks) / extra
		b.ReportMetric(goroutines, "goroutines/link")
		b.ReportMetric(heap, "heap-B/link")
		b.ReportMetric(stacks, "stack-B/link")
		b.Logf("one link: %d goroutines, %d B heap, %d B stacks; %d links: %d goroutines, %d B heap, %d B stacks",
			one.goroutines, one.heap, one.stacks, costNodes, all.goroutines, all.heap, all.stacks)
	}
}

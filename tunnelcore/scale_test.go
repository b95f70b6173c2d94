package tunnelcore

import (
	"context"
	"fmt"
	"io"
	"runtime"
	"sync"
	"testing"
	"time"
)

// TestTenThousandConcurrentConns: 10,000 virtual connections open at once on
// one session over real gRPC each complete an echo exchange. It reports the
// peak heap per connection.
func TestTenThousandConcurrentConns(t *testing.T) {
	if testing.Short() {
		t.Skip("short mode")
	}
	const n = 10000
	node, agent := sessionPair(t, transports[1], Config{}, Config{AcceptBacklog: n})
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	defer cancel()

	// The agent side echoes each connection until EOF.
	var echoes sync.WaitGroup
	go func() {
		for {
			c, err := agent.Accept(ctx)
			if err != nil {
				return
			}
			echoes.Add(1)
			go func() {
				defer echoes.Done()
				defer c.Close()
				io.Copy(c, c)
				c.CloseWrite()
			}()
		}
	}()

	runtime.GC()
	var before runtime.MemStats
	runtime.ReadMemStats(&before)

	conns := make([]*Conn, n)
	for i := range conns {
		c, err := node.Open(ConnectInfo{})
		if err != nil {
			t.Fatal(err)
		}
		conns[i] = c
		if _, err := fmt.Fprintf(c, "hello %05d", i); err != nil {
			t.Fatal(err)
		}
	}
	// All 10,000 are open at once: read every answer only now.
	eventually(t, 30*time.Second, "all connections accepted", func() bool { return agent.NumConns() == n })
	var peak runtime.MemStats
	runtime.ReadMemStats(&peak)

	errs := make(chan error, n)
	var wg sync.WaitGroup
	for i, c := range conns {
		wg.Add(1)
		go func() {
			defer wg.Done()
			c.SetReadDeadline(time.Now().Add(30 * time.Second))
			want := fmt.Sprintf("hello %05d", i)
			got := make([]byte, len(want))
			if _, err := io.ReadFull(c, got); err != nil || string(got) != want {
				errs <- fmt.Errorf("conn %d: %q, %v", i, got, err)
				return
			}
			c.CloseWrite()
			if _, err := io.ReadAll(c); err != nil {
				errs <- fmt.Errorf("conn %d EOF: %v", i, err)
			}
			c.Close()
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	echoes.Wait()
	perConn := float64(peak.HeapInuse-before.HeapInuse) / n
	t.Logf("%d concurrent connections: peak heap %.1f KiB per connection (both ends in this process)", n, perConn/1024)
	eventually(t, 10*time.Second, "tables empty", func() bool { return node.NumConns() == 0 && agent.NumConns() == 0 })
}

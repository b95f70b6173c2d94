package tunnelcore

import (
	"io"
	"net"
	"runtime"
	"sync"
	"testing"
)

// Knobs for tuning runs (environment): FRAME (MaxFrameSize), CHUNK (bytes per
// Write), WB (gRPC read/write buffer sizes), WIN (static gRPC windows).
//
// benchmarkStreams moves b.N chunks of 64 KiB over each of n connections of
// one session and reports throughput and allocations per MiB moved.
func benchmarkStreams(b *testing.B, tr transport, n int) {
	node, agent := sessionPair(b, tr, Config{MaxFrameSize: envInt("FRAME")}, Config{MaxFrameSize: envInt("FRAME")})
	chunk := 64 << 10
	if n := envInt("CHUNK"); n > 0 {
		chunk = n
	}
	buf := make([]byte, chunk)
	conns := make([]*Conn, n)
	peers := make([]*Conn, n)
	for i := range conns {
		conns[i], _ = node.Open(ConnectInfo{})
		conns[i].Write([]byte{0})
		peers[i] = accept(b, agent)
		io.ReadFull(peers[i], make([]byte, 1))
	}
	var ms0, ms1 runtime.MemStats
	runtime.ReadMemStats(&ms0)
	b.SetBytes(int64(chunk * n))
	cpu0 := processCPU()
	b.ResetTimer()
	var wg sync.WaitGroup
	for i := range conns {
		wg.Add(2)
		go func() {
			defer wg.Done()
			for j := 0; j < b.N; j++ {
				if _, err := conns[i].Write(buf); err != nil {
					b.Error(err)
					return
				}
			}
			conns[i].CloseWrite()
		}()
		go func() {
			defer wg.Done()
			if _, err := io.Copy(io.Discard, peers[i]); err != nil {
				b.Error(err)
			}
		}()
	}
	wg.Wait()
	b.StopTimer()
	cpu := processCPU() - cpu0
	runtime.ReadMemStats(&ms1)
	mib := float64(b.N*chunk*n) / (1 << 20)
	b.ReportMetric(cpu.Seconds()/(mib*(1<<20)/1e9), "cpu-s/GB")
	b.ReportMetric(float64(ms1.Mallocs-ms0.Mallocs)/mib, "allocs/MiB")
	for i := range conns {
		conns[i].Close()
		peers[i].Close()
	}
}

func BenchmarkStream(b *testing.B) {
	for _, tr := range transports {
		b.Run(tr.name+"/1conn", func(b *testing.B) { benchmarkStreams(b, tr, 1) })
		b.Run(tr.name+"/8conns", func(b *testing.B) { benchmarkStreams(b, tr, 8) })
	}
}

// BenchmarkLoopbackTCP is the ceiling the gRPC transport runs on: one TCP
// connection on loopback, 64 KiB writes, the reader discarding.
func BenchmarkLoopbackTCP(b *testing.B) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		b.Fatal(err)
	}
	defer l.Close()
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		io.Copy(io.Discard, c)
		c.Close()
	}()
	c, err := net.Dial("tcp", l.Addr().String())
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	b.SetBytes(int64(len(buf)))
	cpu0 := processCPU()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	c.Close()
	<-done
	b.StopTimer()
	b.ReportMetric((processCPU()-cpu0).Seconds()/(float64(b.N*len(buf))/1e9), "cpu-s/GB")
}

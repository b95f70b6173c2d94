package tunnelcore

import (
	"sync"

	"google.golang.org/grpc/mem"
)

// GRPCBufferSize is the read and write buffer size for the gRPC
// connections that carry tunnels (grpc.ReadBufferSize/WriteBufferSize and
// their dial options). gRPC's 32 KiB default costs a syscall per 32 KiB;
// measured on a 2-core machine with BenchmarkStream, 64-256 KiB buffers
// used 15-20% less CPU for the same bytes (1 MiB was slower again, as the
// design notes from the spike).
const GRPCBufferSize = 128 << 10

// poolTiers are the buffer sizes the pool keeps: gRPC's 16 KiB frame reads,
// io.Copy's 32 KiB, a full DATA frame and the larger message reads.
var poolTiers = [...]int{4 << 10, 16 << 10, 32 << 10, 64 << 10, 256 << 10, 1 << 20}

// dirtyPool is a mem.BufferPool that does not zero buffers it hands out.
// gRPC's default pool clears every buffer on Get, which cost more CPU than
// the rest of the data path together (measured: 70% of a pipe benchmark);
// every user of this pool overwrites the bytes it exposes.
type dirtyPool struct {
	tiers [len(poolTiers)]sync.Pool
}

var bufferPool = newDirtyPool()

func newDirtyPool() *dirtyPool {
	p := &dirtyPool{}
	for i, size := range poolTiers {
		p.tiers[i].New = func() any {
			b := make([]byte, size)
			return &b
		}
	}
	return p
}

// BufferPool returns the pool sessions take DATA buffers from. Pass it to
// gRPC (experimental.WithBufferPool / experimental.BufferPool) on the
// tunnel's connections so received frames come from it too.
func BufferPool() mem.BufferPool { return bufferPool }

func (p *dirtyPool) tier(size int) int {
	for i, t := range poolTiers {
		if size <= t {
			return i
		}
	}
	return -1
}

// Get implements mem.BufferPool.
func (p *dirtyPool) Get(size int) *[]byte {
	i := p.tier(size)
	if i < 0 {
		b := make([]byte, size)
		return &b
	}
	bp := p.tiers[i].Get().(*[]byte)
	*bp = (*bp)[:size]
	return bp
}

// Put implements mem.BufferPool.
func (p *dirtyPool) Put(bp *[]byte) {
	c := cap(*bp)
	for i := len(poolTiers) - 1; i >= 0; i-- {
		if c == poolTiers[i] {
			*bp = (*bp)[:c]
			p.tiers[i].Put(bp)
			return
		}
	}
}

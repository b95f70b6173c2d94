package tunnelcore

import (
	"sync"

	"google.golang.org/grpc/mem"
)

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

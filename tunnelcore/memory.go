package tunnelcore

import (
	"bufio"
	"math"
	"os"
	"runtime/debug"
	"strconv"
	"strings"
)

// ConnectionCost is the worst-case memory one virtual connection holds
// outside the budget: a 64 KiB receive window, what it queues in front of
// the sender, and the relay's copy buffers.
const ConnectionCost = 293 << 10

// MemoryLimit is what the process may use: GOMEMLIMIT when set, else the
// cgroup limit, else physical memory.
func MemoryLimit() int64 {
	if l := debug.SetMemoryLimit(-1); l > 0 && l != math.MaxInt64 {
		return l
	}
	if b, err := os.ReadFile("/sys/fs/cgroup/memory.max"); err == nil {
		if v, err := strconv.ParseInt(strings.TrimSpace(string(b)), 10, 64); err == nil && v > 0 {
			return v
		}
	}
	if f, err := os.Open("/proc/meminfo"); err == nil {
		defer f.Close()
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			fields := strings.Fields(sc.Text())
			if len(fields) >= 2 && fields[0] == "MemTotal:" {
				if kb, err := strconv.ParseInt(fields[1], 10, 64); err == nil {
					return kb << 10
				}
			}
		}
	}
	return 4 << 30
}

// Limits are the defaults derived from memory: half of it for the data
// plane, an eighth of that half for the tunnel budget, the
// rest for connections at ConnectionCost each.
type Limits struct {
	Memory         int64
	Budget         int64
	ConnMemory     int64
	MaxConnections int64
}

// DeriveLimits fills the zero values among budget, connMemory and maxConns
// from memory (see Limits).
func DeriveLimits(memory, budget, connMemory, maxConns int64) Limits {
	d := Limits{Memory: memory, Budget: budget, ConnMemory: connMemory, MaxConnections: maxConns}
	half := memory / 2
	if d.Budget <= 0 {
		d.Budget = half / 8
	}
	if d.ConnMemory <= 0 {
		d.ConnMemory = max(half-d.Budget, ConnectionCost)
	}
	if d.MaxConnections <= 0 {
		d.MaxConnections = max(d.ConnMemory/ConnectionCost, 1)
	}
	return d
}

//go:build linux

package main

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"sync"

	"go.uber.org/zap/zapcore"
)

// logCounter is the zapcore.Core of every agent of the fleet: it counts
// their log entries (Info and up) by level, message and reason instead of
// writing them, since N agents reconnecting at once would flood any
// terminal, and keeps the first entry of each kind as an example.
type logCounter struct {
	mu     sync.Mutex
	counts map[string]int
	first  map[string]string
}

func newLogCounter() *logCounter {
	return &logCounter{counts: map[string]int{}, first: map[string]string{}}
}

// Enabled implements zapcore.Core.
func (c *logCounter) Enabled(l zapcore.Level) bool { return l >= zapcore.InfoLevel }

// With implements zapcore.Core; the fleet's loggers carry no fields worth
// counting by.
func (c *logCounter) With([]zapcore.Field) zapcore.Core { return c }

// Check implements zapcore.Core.
func (c *logCounter) Check(e zapcore.Entry, ce *zapcore.CheckedEntry) *zapcore.CheckedEntry {
	if c.Enabled(e.Level) {
		return ce.AddCore(e, c)
	}
	return ce
}

// Write implements zapcore.Core: it counts the entry under its level,
// message and "reason" field (cut to 120 bytes).
func (c *logCounter) Write(e zapcore.Entry, fields []zapcore.Field) error {
	key := e.Level.CapitalString() + " " + e.Message
	for _, f := range fields {
		if f.Key == "reason" && f.Type == zapcore.StringType {
			key += " | reason: " + shorten(f.String, 120)
		}
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.counts[key]++
	if _, ok := c.first[key]; !ok {
		enc := zapcore.NewMapObjectEncoder()
		for _, f := range fields {
			f.AddTo(enc)
		}
		c.first[key] = fmt.Sprint(enc.Fields)
	}
	return nil
}

// Sync implements zapcore.Core.
func (c *logCounter) Sync() error { return nil }

// snapshot returns a copy of the counts so far.
func (c *logCounter) snapshot() map[string]int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return maps.Clone(c.counts)
}

// since returns the counts that grew after prev (a snapshot), and their sum
// for the keys that start with one of the levels given.
func (c *logCounter) since(prev map[string]int, levels ...string) (grown map[string]int, sum int) {
	grown = map[string]int{}
	for k, v := range c.snapshot() {
		if d := v - prev[k]; d > 0 {
			grown[k] = d
			for _, l := range levels {
				if strings.HasPrefix(k, l+" ") {
					sum += d
				}
			}
		}
	}
	return grown, sum
}

// summary formats counts, the largest first, at most max lines.
func summary(counts map[string]int, max int) string {
	keys := slices.Collect(maps.Keys(counts))
	sort.Slice(keys, func(i, j int) bool {
		if counts[keys[i]] != counts[keys[j]] {
			return counts[keys[i]] > counts[keys[j]]
		}
		return keys[i] < keys[j]
	})
	var b strings.Builder
	for i, k := range keys {
		if i == max {
			fmt.Fprintf(&b, "    ... %d more kinds\n", len(keys)-max)
			break
		}
		fmt.Fprintf(&b, "    %7d  %s\n", counts[k], k)
	}
	return b.String()
}

func shorten(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}

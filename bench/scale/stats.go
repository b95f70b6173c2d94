//go:build linux

package main

import (
	"fmt"
	"os"
	"slices"
	"sort"
	"strings"
	"time"
)

// percentile returns the q-quantile (0..1) of ds by the nearest-rank
// method; 0 for none.
func percentile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	s := slices.Clone(ds)
	slices.Sort(s)
	i := int(q*float64(len(s))+0.999999) - 1
	return s[min(max(i, 0), len(s)-1)]
}

func median(ds []time.Duration) time.Duration { return percentile(ds, 0.5) }

// results are the figures of a run, written as "key value" lines for
// bench/scale.sh's table.
type results struct {
	keys []string
	vals map[string]string
}

func newResults() *results { return &results{vals: map[string]string{}} }

// set records a figure; numbers are formatted with format.
func (r *results) set(key, format string, v any) {
	if _, ok := r.vals[key]; !ok {
		r.keys = append(r.keys, key)
	}
	r.vals[key] = fmt.Sprintf(format, v)
}

func (r *results) write(path string) error {
	var b strings.Builder
	for _, k := range r.keys {
		fmt.Fprintf(&b, "%s %s\n", k, r.vals[k])
	}
	if err := os.WriteFile(path, []byte(b.String()), 0o644); err != nil {
		return fmt.Errorf("writing the results: %w", err)
	}
	return nil
}

// secs formats a duration in seconds.
func secs(d time.Duration) float64 { return d.Seconds() }

// ms formats a duration in milliseconds.
func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }

// durations of the nonzero times in at, after t0; missing counts the zeros.
func since(t0 time.Time, at []time.Time) (ds []time.Duration, missing int) {
	for _, t := range at {
		if t.IsZero() {
			missing++
			continue
		}
		ds = append(ds, t.Sub(t0))
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	return ds, missing
}

// histogram prints how many of ds fall in each of the bounds' buckets.
func histogram(ds []time.Duration, bounds []time.Duration) string {
	counts := make([]int, len(bounds)+1)
	for _, d := range ds {
		i := sort.Search(len(bounds), func(i int) bool { return d <= bounds[i] })
		counts[i]++
	}
	var b strings.Builder
	lo := time.Duration(0)
	for i, c := range counts {
		if i < len(bounds) {
			fmt.Fprintf(&b, "    %6s - %-6s %6d\n", lo, bounds[i], c)
			lo = bounds[i]
		} else {
			fmt.Fprintf(&b, "    %6s and up  %6d\n", lo, c)
		}
	}
	return b.String()
}

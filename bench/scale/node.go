//go:build linux

package main

import (
	"bufio"
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"
)

// nodeWatch reads a running Caddy: its process (/proc/<pid>, the pid from
// the file `caddy run --pidfile` writes) and its admin endpoint (/metrics,
// /debug/pprof). The bench never starts or configures it.
type nodeWatch struct {
	admin   string // http://127.0.0.1:port
	pidfile string
	client  *http.Client
}

func newNodeWatch(admin, pidfile string) *nodeWatch {
	return &nodeWatch{
		admin:   strings.TrimSuffix(admin, "/"),
		pidfile: pidfile,
		client:  &http.Client{Timeout: 60 * time.Second, Transport: &http.Transport{DisableKeepAlives: true}},
	}
}

// pid reads the node's pid from the pidfile.
func (n *nodeWatch) pid() (int, error) {
	b, err := os.ReadFile(n.pidfile)
	if err != nil {
		return 0, fmt.Errorf("reading the node's pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pid <= 0 {
		return 0, fmt.Errorf("pidfile %s: %q is not a pid", n.pidfile, b)
	}
	return pid, nil
}

// alive reports whether process pid exists.
func alive(pid int) bool { return syscall.Kill(pid, 0) == nil }

// procStatus is what /proc/<pid>/status and /proc/<pid>/stat tell of a
// process: resident memory now and at its peak, threads and CPU time.
type procStatus struct {
	RSSKiB, HWMKiB, Threads int64
	CPU                     time.Duration // utime + stime
}

// clockTick is the kernel's USER_HZ, the unit of /proc/<pid>/stat's
// times: 100 on every Linux this runs on.
const clockTick = 100

func readProc(pid int) (procStatus, error) {
	var ps procStatus
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return ps, fmt.Errorf("reading the status of process %d: %w", pid, err)
	}
	sc := bufio.NewScanner(bytes.NewReader(b))
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		if len(f) < 2 {
			continue
		}
		v, _ := strconv.ParseInt(f[1], 10, 64)
		switch f[0] {
		case "VmRSS:":
			ps.RSSKiB = v
		case "VmHWM:":
			ps.HWMKiB = v
		case "Threads:":
			ps.Threads = v
		}
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ps, fmt.Errorf("reading the stat of process %d: %w", pid, err)
	}
	// The fields after the command (which may hold spaces) start after
	// its closing parenthesis; utime and stime are fields 14 and 15.
	rest := stat[bytes.LastIndexByte(stat, ')')+1:]
	f := strings.Fields(string(rest))
	if len(f) >= 13 {
		ut, _ := strconv.ParseInt(f[11], 10, 64)
		st, _ := strconv.ParseInt(f[12], 10, 64)
		ps.CPU = time.Duration(ut+st) * time.Second / clockTick
	}
	return ps, nil
}

// get fetches an admin path.
func (n *nodeWatch) get(ctx context.Context, path string) ([]byte, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, n.admin+path, nil)
	if err != nil {
		return nil, fmt.Errorf("admin request %s: %w", path, err)
	}
	resp, err := n.client.Do(req)
	if err != nil {
		return nil, fmt.Errorf("admin %s: %w", path, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, fmt.Errorf("admin %s: reading the answer: %w", path, err)
	}
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("admin %s: status %d: %s", path, resp.StatusCode, shorten(string(body), 200))
	}
	return body, nil
}

// metrics reads the admin endpoint's /metrics and returns each metric's
// value summed over its label sets (the node label, by route...).
func (n *nodeWatch) metrics(ctx context.Context) (map[string]float64, error) {
	body, err := n.get(ctx, "/metrics")
	if err != nil {
		return nil, err
	}
	return parseMetrics(body), nil
}

// parseMetrics sums the samples of Prometheus' text format by metric name,
// and keeps each series too, under its name and labels as written.
func parseMetrics(body []byte) map[string]float64 {
	out := map[string]float64{}
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if line == "" || line[0] == '#' {
			continue
		}
		name, rest := line, ""
		if i := strings.IndexAny(line, "{ "); i >= 0 {
			name, rest = line[:i], line[i:]
		}
		series := name
		if j := strings.LastIndexByte(rest, '}'); j >= 0 {
			series, rest = name+rest[:j+1], rest[j+1:]
		}
		f := strings.Fields(rest)
		if len(f) == 0 {
			continue
		}
		if v, err := strconv.ParseFloat(f[0], 64); err == nil {
			out[name] += v
			if series != name {
				out[series] = v
			}
		}
	}
	return out
}

// gc makes the node collect its garbage: the heap profile endpoint runs a
// GC first with gc=1. It returns the profile (inuse_space after the GC).
func (n *nodeWatch) gc(ctx context.Context) ([]byte, error) {
	return n.get(ctx, "/debug/pprof/heap?gc=1")
}

// nodeSnapshot is the node's state at one moment.
type nodeSnapshot struct {
	PID        int
	Proc       procStatus
	Goroutines float64
	HeapInuse  float64 // bytes, go_memstats_heap_inuse_bytes
	StackInuse float64 // bytes, go_memstats_stack_inuse_bytes
	Sessions   float64 // sluice_tunnel_sessions
	OnLane     float64 // sluice_tunnel_sessions_lane
	HeapProf   []byte  // the heap profile taken with the GC, if any
}

// snapshot reads the node, after a GC when gc is set.
func (n *nodeWatch) snapshot(ctx context.Context, gc bool) (nodeSnapshot, error) {
	var s nodeSnapshot
	pid, err := n.pid()
	if err != nil {
		return s, err
	}
	s.PID = pid
	if gc {
		if s.HeapProf, err = n.gc(ctx); err != nil {
			return s, err
		}
	}
	m, err := n.metrics(ctx)
	if err != nil {
		return s, err
	}
	s.Goroutines, s.HeapInuse, s.StackInuse = m["go_goroutines"], m["go_memstats_heap_inuse_bytes"], m["go_memstats_stack_inuse_bytes"]
	s.Sessions, s.OnLane = m["sluice_tunnel_sessions"], m["sluice_tunnel_sessions_lane"]
	if _, ok := m["go_goroutines"]; !ok {
		return s, errors.New("the node's /metrics has no go_goroutines")
	}
	if s.Proc, err = readProc(pid); err != nil {
		return s, err
	}
	return s, nil
}

// goroutineGroup is one stack of the node's goroutine profile and how many
// goroutines share it.
type goroutineGroup struct {
	Count  int
	Frames []string // function names, innermost first
}

// goroutines reads the node's goroutine profile (debug=1: one entry per
// distinct stack, with its count), the largest groups first.
func (n *nodeWatch) goroutines(ctx context.Context) ([]goroutineGroup, error) {
	body, err := n.get(ctx, "/debug/pprof/goroutine?debug=1")
	if err != nil {
		return nil, err
	}
	var groups []goroutineGroup
	var cur *goroutineGroup
	sc := bufio.NewScanner(bytes.NewReader(body))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		switch {
		case strings.Contains(line, " @ 0x"):
			c, err := strconv.Atoi(strings.Fields(line)[0])
			if err != nil {
				cur = nil
				continue
			}
			groups = append(groups, goroutineGroup{Count: c})
			cur = &groups[len(groups)-1]
		case cur != nil && strings.HasPrefix(line, "#\t0x"):
			f := strings.Fields(line)
			if len(f) >= 3 {
				fn := f[2]
				if i := strings.LastIndex(fn, "+0x"); i > 0 {
					fn = fn[:i]
				}
				cur.Frames = append(cur.Frames, fn)
			}
		case line == "":
			cur = nil
		}
	}
	sort.Slice(groups, func(i, j int) bool { return groups[i].Count > groups[j].Count })
	return groups, nil
}

// where names a goroutine group by its innermost frame outside the
// runtime and the standard library's blocking calls, and the frame that
// started it (the outermost).
func (g goroutineGroup) where() string {
	inner := ""
	for _, f := range g.Frames {
		if strings.HasPrefix(f, "runtime.") || strings.HasPrefix(f, "internal/") || strings.HasPrefix(f, "sync.") ||
			strings.HasPrefix(f, "syscall.") || strings.HasPrefix(f, "net.") || strings.HasPrefix(f, "bufio.") ||
			strings.HasPrefix(f, "io.") || strings.HasPrefix(f, "time.") {
			continue
		}
		inner = f
		break
	}
	outer := ""
	if len(g.Frames) > 0 {
		outer = g.Frames[len(g.Frames)-1]
	}
	if inner == outer || inner == "" {
		return outer
	}
	return inner + " (started in " + outer + ")"
}

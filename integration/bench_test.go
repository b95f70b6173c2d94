package integration

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestBenchScriptsRun runs bench/http.sh, bench/tcp.sh, bench/udp.sh and
// bench/clients.sh in their quick mode, and bench/scale.sh at 200 agents,
// against the xcaddy-built Caddy: they are part of what the repository
// promises (the README's performance figures come from them), so a change
// that breaks their setup, a load or the report must fail here. It checks
// that each run completes, warns of nothing, and fills every sluice figure
// with a number; the figures themselves are not judged (tests never assert
// speed). http.sh runs pinned as two hosts with two rounds, which exercises
// BENCH_PIN and the rounds' medians as well.
//
// The scripts load both CPUs for about a minute, which would crowd the
// tests of the other packages running beside this one, so the test runs
// only with SLUICE_BENCH_SMOKE=1: test.sh runs it as its last step, alone.
func TestBenchScriptsRun(t *testing.T) {
	if os.Getenv("SLUICE_BENCH_SMOKE") != "1" {
		t.Skip("set SLUICE_BENCH_SMOKE=1 (test.sh runs this test alone, after the suite)")
	}
	caddy := caddyBinary(t)
	needCommand(t, "wrk")
	needCommand(t, "curl")
	for _, tc := range []struct {
		script string
		env    []string
		rows   []string // rows whose sluice column must be a number
	}{
		{"bench/http.sh", []string{"BENCH_PIN=1", "BENCH_ROUNDS=2"}, []string{
			"1x 64 MiB download, MB/s", "8x 16 MiB aggregate, MB/s", "small GET /, requests/s",
			"TTFB fresh conn, median ms (lower)", "Caddy RSS per idle conn, KiB", "1x download: agent CPU s/GB",
		}},
		{"bench/tcp.sh", nil, []string{
			"1x 64 MiB download, MB/s", "small GET /, requests/s", "TTFB fresh conn, median ms (lower)",
		}},
		{"bench/udp.sh", []string{"DNS_QUERIES=5000", "RATES=100M", "IPERF_SECS=2"}, []string{
			"dnsperf queries/s", "dnsperf p50 latency, ms (lower)", "iperf3 -u -b 100M: received Mbit/s",
		}},
		{"bench/clients.sh", nil, []string{
			"gRPC unary calls/s (ceiling: caddy)", "redis SET/s -P 1 (ceiling: l4 proxy)",
			"redis GET/s -P 1 (ceiling: l4 proxy)", "Connection: close req/s (caddy)",
		}},
		{"bench/scale.sh", []string{"SCALE_N=200", "SCALE_LANES=on", "SCALE_ADV_REPS=2"}, nil},
	} {
		t.Run(tc.script, func(t *testing.T) {
			if tc.script == "bench/http.sh" {
				needCommand(t, "taskset")
			}
			if tc.script == "bench/udp.sh" {
				for _, tool := range []string{"dnsmasq", "dnsperf", "iperf3"} {
					needCommand(t, tool)
				}
			}
			if tc.script == "bench/clients.sh" {
				needGoTool(t, "ghz")
				needCommand(t, "redis-server")
				needCommand(t, "redis-benchmark")
				needCommand(t, "jq")
			}
			ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
			defer cancel()
			var stdout, stderr bytes.Buffer
			cmd := exec.CommandContext(ctx, "bash", tc.script)
			cmd.Dir = ".."
			cmd.Env = append(os.Environ(), append([]string{"BENCH_QUICK=1", "CADDY=" + caddy}, tc.env...)...)
			cmd.Stdout, cmd.Stderr = &stdout, &stderr
			if err := cmd.Run(); err != nil {
				t.Fatalf("%s: %v\nstderr:\n%s", tc.script, err, stderr.String())
			}
			if strings.Contains(stderr.String(), "WARNING") {
				t.Fatalf("%s warned:\n%s", tc.script, stderr.String())
			}
			report := stdout.String()
			for _, row := range tc.rows {
				if v := sluiceColumn(report, row); !benchNumber.MatchString(v) {
					t.Errorf("%s: row %q: sluice column %q is not a number\n%s", tc.script, row, v, report)
				}
			}
			if tc.script == "bench/scale.sh" {
				checkScaleReport(t, report)
			}
			if tc.script == "bench/http.sh" && !strings.Contains(report, "pinned as two hosts (BENCH_PIN)") {
				t.Errorf("pinned run does not say so:\n%s", report)
			}
		})
	}
}

// checkScaleReport checks that bench/scale.sh's table has every figure of
// a run (a number in its one column) and that every agent came back after
// the storm.
func checkScaleReport(t *testing.T, report string) {
	t.Helper()
	for _, row := range []string{
		"time until all N connected, s", "node RSS per idle session, KiB (target <= 64)",
		"node goroutines per idle session", "Advertise of 1 route at N sessions: Run to ack, ms",
		"agents back: all (or the last of those back), s", "probe: p99 latency, ms",
	} {
		if v := scaleCell(report, row); !benchNumber.MatchString(v) {
			t.Errorf("bench/scale.sh: row %q: %q is not a number\n%s", row, v, report)
		}
	}
	if v := scaleCell(report, "agents not back by SCALE_STORM_TIMEOUT"); v != "0" {
		t.Errorf("bench/scale.sh: %s agents not back after the storm\n%s", v, report)
	}
}

// scaleCell returns the first value cell of the scale table's row label.
func scaleCell(report, label string) string {
	for _, line := range strings.Split(report, "\n") {
		cells := strings.Split(line, "|")
		if len(cells) >= 2 && strings.TrimSpace(cells[0]) == label {
			return strings.TrimSpace(cells[1])
		}
	}
	return ""
}

// needGoTool returns the path of a tool `go install` put in GOPATH/bin (or
// on PATH), skipping the test without it (failing it in CI).
func needGoTool(t *testing.T, name string) string {
	t.Helper()
	if p, err := exec.LookPath(name); err == nil {
		return p
	}
	out, err := exec.Command("go", "env", "GOPATH").Output()
	if err == nil {
		p := filepath.Join(strings.TrimSpace(string(out)), "bin", name)
		if _, err := os.Stat(p); err == nil {
			return p
		}
	}
	if os.Getenv("CI") != "" {
		t.Fatalf("%s is required in CI (.ci/run installs it)", name)
	}
	t.Skipf("%s not installed", name)
	return ""
}

// benchNumber is a figure of the bench report.
var benchNumber = regexp.MustCompile(`^[0-9]+(\.[0-9]+)?$`)

// sluiceColumn returns the cell of the "sluice" column in the report row
// whose label is label ("" when there is no such row).
func sluiceColumn(report, label string) string {
	var header []string
	for _, line := range strings.Split(report, "\n") {
		cells := strings.Split(line, "|")
		for i := range cells {
			cells[i] = strings.TrimSpace(cells[i])
		}
		if len(cells) < 2 {
			continue
		}
		if cells[0] == "metric" {
			header = cells
			continue
		}
		if cells[0] != label || header == nil {
			continue
		}
		for i, h := range header {
			if h == "sluice" && i < len(cells) {
				return cells[i]
			}
		}
	}
	return ""
}

package integration

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"regexp"
	"strings"
	"testing"
	"time"
)

// TestBenchScriptsRun runs bench/http.sh, bench/tcp.sh and bench/udp.sh in their quick
// mode against the xcaddy-built Caddy: they are part of what the repository
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
			if tc.script == "bench/http.sh" && !strings.Contains(report, "pinned as two hosts (BENCH_PIN)") {
				t.Errorf("pinned run does not say so:\n%s", report)
			}
		})
	}
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

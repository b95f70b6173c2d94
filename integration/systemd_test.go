package integration

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// debianCaddyUnit is the caddy.service of Caddy's Debian package (from
// github.com/caddyserver/dist), which contrib's drop-in extends, with
// ExecStart and ExecReload pointing at caddy.
const debianCaddyUnit = `[Unit]
Description=Caddy
Documentation=https://caddyserver.com/docs/
After=network.target network-online.target
Requires=network-online.target

[Service]
Type=notify
User=caddy
Group=caddy
ExecStart={CADDY} run --environ --config /etc/caddy/Caddyfile
ExecReload={CADDY} reload --config /etc/caddy/Caddyfile --force
TimeoutStopSec=5s
LimitNOFILE=1048576
PrivateTmp=true
ProtectSystem=full
AmbientCapabilities=CAP_NET_ADMIN CAP_NET_BIND_SERVICE

[Install]
WantedBy=multi-user.target
`

// systemdAnalyze returns the path of systemd-analyze: the test skips
// without it, except in CI (.ci/run installs systemd).
func systemdAnalyze(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("systemd-analyze")
	if err != nil {
		if os.Getenv("CI") != "" {
			t.Fatal("systemd-analyze is required in CI (.ci/run installs systemd)")
		}
		t.Skip("systemd-analyze not installed (Debian: apt-get install systemd)")
	}
	return p
}

// TestSystemdUnitsVerify: systemd-analyze verify accepts contrib's units
// without a single warning: sluice-agent.service, and Caddy's unit with
// contrib's drop-in. verify checks that ExecStart's binary exists, so the
// test installs copies into a unit directory of its own with ExecStart
// pointing at a freshly built sluice-agent (and, for Caddy's unit, at an
// executable standing in for caddy); SYSTEMD_UNIT_PATH makes systemd read
// the drop-in from there. A control run with a bad key in the drop-in
// shows verify really reads it.
func TestSystemdUnitsVerify(t *testing.T) {
	analyze := systemdAnalyze(t)
	agentBin := buildAgent(t)
	// Any executable stands in for caddy: verify does not run it.
	caddyStandIn, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	agentUnit := readContrib(t, "sluice-agent.service")
	if !strings.Contains(agentUnit, "ExecStart=/usr/local/bin/sluice-agent ") {
		t.Fatal("sluice-agent.service: ExecStart is not /usr/local/bin/sluice-agent")
	}
	writeUnit(t, filepath.Join(dir, "sluice-agent.service"),
		strings.Replace(agentUnit, "ExecStart=/usr/local/bin/sluice-agent ", "ExecStart="+agentBin+" ", 1))
	writeUnit(t, filepath.Join(dir, "caddy.service"), strings.ReplaceAll(debianCaddyUnit, "{CADDY}", caddyStandIn))
	dropIn := readContrib(t, filepath.Join("caddy.service.d", "sluice.conf"))
	writeUnit(t, filepath.Join(dir, "caddy.service.d", "sluice.conf"), dropIn)

	verify := func() (string, error) {
		cmd := exec.Command(analyze, "verify", "--man=no",
			filepath.Join(dir, "sluice-agent.service"), filepath.Join(dir, "caddy.service"))
		// The trailing ':' keeps systemd's own directories after dir.
		cmd.Env = append(os.Environ(), "SYSTEMD_UNIT_PATH="+dir+":")
		cmd.Dir = dir
		out, err := cmd.CombinedOutput()
		return strings.TrimSpace(string(out)), err
	}
	out, err := verify()
	if err != nil || out != "" {
		t.Fatalf("systemd-analyze verify: %v\n%s", err, out)
	}
	t.Logf("systemd-analyze verify passed on sluice-agent.service and caddy.service + sluice.conf")

	writeUnit(t, filepath.Join(dir, "caddy.service.d", "sluice.conf"), dropIn+"NotASystemdKey=1\n")
	out, _ = verify()
	if !strings.Contains(out, "sluice.conf") || !strings.Contains(out, "NotASystemdKey") {
		t.Fatalf("verify did not read the drop-in (a bad key in it went unreported): %q", out)
	}
}

func readContrib(t *testing.T, name string) string {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("..", "contrib", "systemd", name))
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func writeUnit(t *testing.T, path, text string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
}

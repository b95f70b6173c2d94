package integration

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// caddyBinary returns the xcaddy-built Caddy named by SLUICE_CADDY_BIN
// (test.sh builds it with ./xcaddy.sh). Without it the binary tests skip,
// except in CI, where they must run.
func caddyBinary(t *testing.T) string {
	t.Helper()
	bin := os.Getenv("SLUICE_CADDY_BIN")
	if bin == "" {
		if os.Getenv("CI") != "" {
			t.Fatal("SLUICE_CADDY_BIN is required in CI (test.sh sets it)")
		}
		t.Skip("SLUICE_CADDY_BIN not set; run ./test.sh or ./xcaddy.sh")
	}
	abs, err := filepath.Abs(bin)
	if err != nil {
		t.Fatal(err)
	}
	return abs
}

// buildAgent builds the sluice-agent binary.
func buildAgent(t *testing.T) string {
	t.Helper()
	out := filepath.Join(t.TempDir(), "sluice-agent")
	cmd := exec.Command("go", "build", "-o", out, "../agent/cmd/sluice-agent")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("building sluice-agent: %v\n%s", err, b)
	}
	return out
}

// startProcess runs a command until the test ends, keeping its output for
// failure messages.
func startProcess(t *testing.T, name string, args ...string) *bytes.Buffer {
	t.Helper()
	_, out := launchProcess(t, name, args...)
	return out
}

// writeCaddyfile writes a Caddyfile for the binary into a temporary
// directory and returns its path: the global options given (admin, sluice
// ...), with no persisted config and storage in that directory, then the
// sites.
func writeCaddyfile(t *testing.T, global, sites string) string {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "Caddyfile")
	text := fmt.Sprintf("{\n\tpersist_config off\n\tstorage file_system %s\n%s\n}\n\n%s\n", filepath.Join(dir, "data"), global, sites)
	if err := os.WriteFile(path, []byte(text), 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

// launchProcess is startProcess that also returns the command.
func launchProcess(t *testing.T, name string, args ...string) (*exec.Cmd, *bytes.Buffer) {
	t.Helper()
	var out bytes.Buffer
	cmd := exec.Command(name, args...)
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan struct{})
	go func() { cmd.Wait(); close(done) }()
	t.Cleanup(func() {
		cmd.Process.Signal(os.Interrupt)
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			cmd.Process.Kill()
			<-done
		}
		if t.Failed() {
			t.Logf("%s output:\n%s", filepath.Base(name), out.String())
		}
	})
	return cmd, &out
}

// TestXcaddyBinarySmoke: the real binary lists the sluice modules and one
// request goes through it and the real sluice-agent binary.
func TestXcaddyBinarySmoke(t *testing.T) {
	caddyBin := caddyBinary(t)
	curl := needCommand(t, "curl")
	mods, err := exec.Command(caddyBin, "list-modules").Output()
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range []string{"sluice", "http.handlers.sluice", "http.reverse_proxy.upstreams.sluice", "http.reverse_proxy.transport.sluice"} {
		if !strings.Contains("\n"+string(mods), "\n"+m+"\n") {
			t.Fatalf("list-modules lacks %s", m)
		}
	}

	httpPort, controlPort := freePort(t), freePort(t)
	caddyfile := writeCaddyfile(t, fmt.Sprintf(`	admin off
	auto_https off
	sluice {
		listen 127.0.0.1:%d
		token smoke-token
	}`, controlPort), fmt.Sprintf(`http://:%d {
	bind 127.0.0.1
	sluice
}`, httpPort))
	startProcess(t, caddyBin, "run", "--config", caddyfile, "--adapter", "caddyfile")
	up := startUpstream(t, "smoke")
	startProcess(t, buildAgent(t), "-server", fmt.Sprintf("grpc://127.0.0.1:%d", controlPort),
		"-token", "smoke-token", "-id", "smoke-agent", "-upstream", "smoke.test="+up)

	var out []byte
	eventually(t, 20*time.Second, "a request through the binaries", func() bool {
		out, err = exec.Command(curl, "-sS", "--max-time", "5", "-H", "Host: smoke.test", fmt.Sprintf("http://127.0.0.1:%d/", httpPort)).Output()
		return err == nil && strings.Contains(string(out), "Hello from smoke")
	})
}

// TestReadmeDemoCommand runs the README's demo command the way a newcomer
// would, in its self-checking mode, on free ports.
func TestReadmeDemoCommand(t *testing.T) {
	caddyBin := caddyBinary(t)
	needCommand(t, "curl")
	cmd := exec.Command("../demo/run.sh", "--check")
	cmd.Env = append(os.Environ(),
		"DEMO_WORK="+t.TempDir(),
		fmt.Sprintf("DEMO_HTTP_PORT=%d", freePort(t)),
		fmt.Sprintf("DEMO_CONTROL_PORT=%d", freePort(t)),
		fmt.Sprintf("DEMO_UPSTREAM_PORT=%d", freePort(t)),
		"DEMO_CADDY_BIN="+caddyBin,
	)
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Hello from the private upstream") {
		t.Fatalf("demo/run.sh --check: %v\n%s", err, out)
	}
}

// TestValidateTakesNoAgentConnection: `caddy validate` of a config whose
// control address another Caddy serves neither binds it (Caddy listens
// with SO_REUSEPORT: a validating process that bound it would take a share
// of the agents' new connections and drop them as it exits) nor leaves
// anything listening: the control plane listens from App.Start, which
// validate never runs.
func TestValidateTakesNoAgentConnection(t *testing.T) {
	caddyBin := caddyBinary(t)
	c := startCaddy(t, "")
	control := fmt.Sprintf("127.0.0.1:%d", c.controlPort)
	spare := freePort(t)
	caddyfile := writeCaddyfile(t, fmt.Sprintf(`	admin off
	sluice {
		listen %s
		token %s
	}`, control, testToken), fmt.Sprintf("http://127.0.0.1:%d {\n\tsluice\n}", spare))

	// Agents' connections, each new, each asking ListNodes with the token,
	// for as long as the validations run.
	stop := make(chan struct{})
	var calls, failed atomic.Int64
	var firstErr atomic.Value
	done := make(chan struct{})
	go func() {
		defer close(done)
		for {
			select {
			case <-stop:
				return
			default:
			}
			if err := listNodesOnce(control); err != nil {
				failed.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
			}
			calls.Add(1)
		}
	}()
	for range 5 {
		if out, err := exec.Command(caddyBin, "validate", "--config", caddyfile, "--adapter", "caddyfile").CombinedOutput(); err != nil {
			t.Fatalf("caddy validate: %v\n%s", err, out)
		}
	}
	close(stop)
	<-done
	if failed.Load() > 0 {
		t.Fatalf("%d of %d agent connections failed while caddy validate ran: %v", failed.Load(), calls.Load(), firstErr.Load())
	}
	if calls.Load() == 0 {
		t.Fatal("no agent connection was made while caddy validate ran")
	}
	if c, err := net.DialTimeout("tcp", fmt.Sprintf("127.0.0.1:%d", spare), time.Second); err == nil {
		c.Close()
		t.Fatalf("something listens on the validated site's port %d after validate returned", spare)
	}
}

// listNodesOnce opens a new connection to the control address and asks
// ListNodes with the token.
func listNodesOnce(control string) error {
	cc, err := grpc.NewClient(control, grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithDefaultCallOptions(grpc.ForceCodecV2(tunnelpb.Codec{})))
	if err != nil {
		return err
	}
	defer cc.Close()
	ctx, cancel := context.WithTimeout(metadata.AppendToOutgoingContext(context.Background(), "authorization", "Bearer "+testToken), 5*time.Second)
	defer cancel()
	_, err = tunnelpb.NewTunnelClient(cc).ListNodes(ctx, &tunnelpb.ListNodesRequest{})
	return err
}

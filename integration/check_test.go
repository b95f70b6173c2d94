package integration

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"

	"github.com/sluice-tunnel/sluice/agent"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// checkRun is one run of sluice-agent check (or another command).
type checkRun struct {
	code           int
	stdout, stderr string
}

func (r checkRun) String() string {
	return fmt.Sprintf("exit %d\nstdout:\n%s\nstderr:\n%s", r.code, r.stdout, r.stderr)
}

// runAgentCommand runs the sluice-agent binary bin with args, with no
// SLUICE_* variable of the test's environment, and waits (bounded) for
// its exit.
func runAgentCommand(t *testing.T, bin string, args ...string) checkRun {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	cmd := exec.CommandContext(ctx, bin, args...)
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "SLUICE_") {
			cmd.Env = append(cmd.Env, kv)
		}
	}
	var stdout, stderr bytes.Buffer
	cmd.Stdout, cmd.Stderr = &stdout, &stderr
	err := cmd.Run()
	r := checkRun{stdout: stdout.String(), stderr: stderr.String()}
	var exit *exec.ExitError
	switch {
	case err == nil:
	case errors.As(err, &exit):
		r.code = exit.ExitCode()
	default:
		t.Fatalf("running %s %v: %v\n%s", bin, args, err, r)
	}
	return r
}

// TestAgentCheckCommand: the sluice-agent binary's check against a real
// Caddy node. A config the node accepts exits 0 and names its routes; a
// listen port outside tcp_port_range exits 4 naming the route and the
// node's reason; a wrong token exits 3 naming authentication; an invalid
// config exits 2 without dialing. A check never disturbs a running agent
// of the same id, and leaves no session behind.
func TestAgentCheckCommand(t *testing.T) {
	rangePort := freePort(t)
	outsidePort := freePort(t)
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("tcp_port_range %d-%d", rangePort, rangePort)}, `http://app.test {
	sluice
}`)
	bin := buildAgent(t)
	up := startUpstream(t, "app")
	running := startAgent(t, c.serverURL(), "agent-main", agent.Upstream{Host: "app.test", Target: up})
	base := []string{"check", "-server", c.serverURL(), "-token", testToken, "-id", "agent-main"}

	t.Run("accepted", func(t *testing.T) {
		r := runAgentCommand(t, bin, append(base,
			"-upstream", "app.test=http://127.0.0.1:1",
			"-upstream", fmt.Sprintf("listen_port=%d,target=tcp://127.0.0.1:1", rangePort))...)
		if r.code != 0 {
			t.Fatalf("want exit 0:\n%s", r)
		}
		t.Logf("%s", r)
		for _, want := range []string{"accepted  app.test", fmt.Sprintf("accepted  :%d", rangePort), "0 rejected", "agent-main-check-", "ok: every node accepted every route"} {
			if !strings.Contains(r.stdout, want) {
				t.Errorf("stdout lacks %q:\n%s", want, r)
			}
		}
	})

	t.Run("port outside tcp_port_range", func(t *testing.T) {
		r := runAgentCommand(t, bin, append(base,
			"-upstream", "app.test=http://127.0.0.1:1",
			"-upstream", fmt.Sprintf("listen_port=%d,target=tcp://127.0.0.1:1", outsidePort))...)
		if r.code != 4 {
			t.Fatalf("want exit 4 (rejected):\n%s", r)
		}
		reason := fmt.Sprintf("port %d is outside tcp_port_range", outsidePort)
		if want := fmt.Sprintf("rejected  :%d: %s", outsidePort, reason); !strings.Contains(r.stdout, want) {
			t.Errorf("stdout lacks %q:\n%s", want, r)
		}
		if !strings.Contains(r.stdout, "accepted  app.test") {
			t.Errorf("stdout does not name the accepted route:\n%s", r)
		}
		if want := fmt.Sprintf("route rejected: :%d on node", outsidePort); !strings.Contains(r.stderr, want) || !strings.Contains(r.stderr, reason) {
			t.Errorf("stderr lacks %q and the reason:\n%s", want, r)
		}
	})

	t.Run("wrong token", func(t *testing.T) {
		r := runAgentCommand(t, bin, "check", "-server", c.serverURL(), "-token", "not-the-node-token-0123456789",
			"-upstream", "app.test=http://127.0.0.1:1")
		if r.code != 3 {
			t.Fatalf("want exit 3 (not reached):\n%s", r)
		}
		if !strings.Contains(r.stderr, "authentication failed") || !strings.Contains(r.stdout, "not reached") {
			t.Errorf("output does not name authentication:\n%s", r)
		}
	})

	t.Run("invalid config", func(t *testing.T) {
		r := runAgentCommand(t, bin, "check", "-server", c.serverURL(), "-token", testToken,
			"-upstream", "app.test=ftp://127.0.0.1:1")
		if r.code != 2 || !strings.Contains(r.stderr, "configuration") || r.stdout != "" {
			t.Fatalf("want exit 2 naming the configuration, nothing on stdout:\n%s", r)
		}
	})

	t.Run("nothing listening", func(t *testing.T) {
		r := runAgentCommand(t, bin, "check", "-server", fmt.Sprintf("grpc://127.0.0.1:%d", freePort(t)), "-token", testToken,
			"-upstream", "app.test=http://127.0.0.1:1")
		if r.code != 3 || !strings.Contains(r.stderr, "nothing listens there") {
			t.Fatalf("want exit 3 with the connection hint:\n%s", r)
		}
	})

	// The checks advertised app.test beside agent-main and left: it still
	// serves app.test on its first session (no check displaced it), and
	// the check's listen port is released.
	if n := running.Sessions(); n != 1 || running.State() != agent.StateConnected {
		t.Fatalf("the running agent of the same id: %d sessions, state %v; want its first session, connected", n, running.State())
	}
	if code, body := get(t, c, "app.test", "/"); code != http.StatusOK || !strings.Contains(body, "Hello from app") {
		t.Fatalf("app.test after the checks: %d %q", code, body)
	}
	eventually(t, 10*time.Second, "the check's listen port released", func() bool {
		r := runAgentCommand(t, bin, append(base, "-upstream", fmt.Sprintf("listen_port=%d,target=tcp://127.0.0.1:1", rangePort))...)
		return r.code == 0
	})
}

// TestAgentVersionCommand: sluice-agent version prints the build line and
// sluice's module from the build info.
func TestAgentVersionCommand(t *testing.T) {
	bin := buildAgent(t)
	r := runAgentCommand(t, bin, "version")
	if r.code != 0 {
		t.Fatalf("want exit 0:\n%s", r)
	}
	first, _, _ := strings.Cut(r.stdout, "\n")
	if !strings.HasPrefix(first, "sluice-agent ") || !strings.Contains(r.stdout, "module "+tunnelpb.ModulePath+" ") {
		t.Fatalf("version output:\n%s", r)
	}
	if r2 := runAgentCommand(t, bin, "-version"); r2.code != 0 || r2.stdout != r.stdout {
		t.Fatalf("-version: %s", r2)
	}
}

// TestAgentCheckBesideRunningPortOwner: a check run beside the agent of
// its configured id, which holds a listen port of the configuration, is
// refused that port only because that agent holds it (the check
// advertises under an id of its own, which sorts after it): the check
// reports it as held by the running agent and passes, while a port held by
// an agent of another id stays a rejection.
func TestAgentCheckBesideRunningPortOwner(t *testing.T) {
	port, otherPort := freePort(t), freePort(t)
	lo, hi := min(port, otherPort), max(port, otherPort)
	c := startCaddyWith(t, caddyOptions{Sluice: fmt.Sprintf("tcp_port_range %d %d", lo, hi)}, `http://app.test {
	sluice
}`)
	route := agent.Upstream{ListenPort: port, Target: "tcp://127.0.0.1:1"}
	startAgent(t, c.serverURL(), "agent-main", route)
	startAgent(t, c.serverURL(), "agent-0ther", agent.Upstream{ListenPort: otherPort, Target: "tcp://127.0.0.1:1"})

	check := func(t *testing.T, routes ...agent.Upstream) agent.CheckResult {
		t.Helper()
		cfg := &agent.Config{Server: c.serverURL(), Token: testToken, ID: "agent-main", Upstreams: routes}
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		res, err := agent.Check(ctx, cfg, nil)
		if err != nil {
			t.Fatalf("Check: %v", err)
		}
		if len(res.Nodes) != 1 {
			t.Fatalf("%d nodes checked, want 1", len(res.Nodes))
		}
		return res
	}

	t.Run("port of the running agent of this id", func(t *testing.T) {
		res := check(t, route)
		if err := res.Err(); err != nil {
			t.Fatalf("check beside the port's owner of the same id: %v", err)
		}
		n := res.Nodes[0]
		if len(n.HeldByAgent) != 1 || n.HeldByAgent[0].ListenPort != port || len(n.Rejected) != 0 {
			t.Fatalf("held %+v, rejected %+v; want port %d held by the running agent", n.HeldByAgent, n.Rejected, port)
		}
	})

	t.Run("port of an agent of another id", func(t *testing.T) {
		res := check(t, agent.Upstream{ListenPort: otherPort, Target: "tcp://127.0.0.1:1"})
		if err := res.Err(); !errors.Is(err, agent.ErrCheckRejected) {
			t.Fatalf("check of a port another agent holds: %v, want ErrCheckRejected", err)
		}
		if n := res.Nodes[0]; len(n.HeldByAgent) != 0 || len(n.Rejected) != 1 {
			t.Fatalf("held %+v, rejected %+v; want one rejection", n.HeldByAgent, n.Rejected)
		}
	})
}

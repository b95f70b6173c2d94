package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/sluice-tunnel/sluice/agent"
	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

// Exit codes of sluice-agent. Distinct codes let a deployment script (or
// a systemd ExecStartPre) tell a typo from an unreachable node from a
// route the node will not take.
const (
	// exitFailed: the agent failed at run time (or its logger could not
	// be made).
	exitFailed = 1
	// exitConfig: the flags, environment or config file are invalid.
	exitConfig = 2
	// exitUnreachable (check): a node could not be reached, refused the
	// credential, or did not answer the Advertise.
	exitUnreachable = 3
	// exitRejected (check): a node rejected at least one route.
	exitRejected = 4
)

// commandsHelp follows the flags in -h.
const commandsHelp = `
Commands:
  sluice-agent [flags]          run the agent
  sluice-agent check [flags]    connect, authenticate and advertise with the
                                same configuration, print what the node
                                accepted and rejected, leave and exit
                                (sluice-agent check -h for the exit codes)
  sluice-agent version          print the version and build information
`

// checkHelp heads the help of sluice-agent check.
const checkHelp = `Usage: sluice-agent check [flags]

Loads the configuration as the agent does (config file, environment,
flags), connects to the node named by server (with server_each_address, to
each address of its name), authenticates, advertises the upstreams and
prints what each node accepted and rejected, and the overlaps with agents
of other credentials. Then it leaves the node as on SIGTERM and exits.

It advertises under an id of its own (the configured id with a
"-check-<random>" suffix), so it never displaces a running agent of the
configured id. Logs (warnings and errors, unless log_level is debug) go to
stderr, the report to stdout.

Exit codes:
  0  every node accepted every route
  2  the configuration is invalid (nothing was dialed)
  3  a node could not be reached, refused the credential (authentication
     failed) or did not answer the Advertise
  4  a node rejected a route (the route and the reason are printed)

`

// versionText is what sluice-agent version prints.
func versionText() string {
	return tunnelpb.VersionText("sluice-agent", agent.Version)
}

// runCheck is sluice-agent check: it returns the exit code.
func runCheck(args []string, stdout, stderr io.Writer, getenv func(string) string) int {
	cfg, err := agent.ParseFlags(args, getenv)
	switch {
	case errors.Is(err, agent.ErrVersion):
		fmt.Fprint(stdout, versionText())
		return 0
	case errors.Is(err, flag.ErrHelp):
		// The flags are the run command's: its usage without its own
		// head line.
		fmt.Fprint(stdout, checkHelp)
		fmt.Fprintln(stdout, strings.TrimPrefix(err.Error(), "Usage: sluice-agent [flags]\n\n"))
		return 0
	case err != nil:
		fmt.Fprintf(stderr, "sluice-agent check: configuration: %v\n", err)
		return exitConfig
	}
	// The report is the output; the agent's info lines (its limits, say)
	// would bury it.
	level := max(cfg.ZapLevel(), zapcore.WarnLevel)
	if cfg.ZapLevel() == zapcore.DebugLevel {
		level = zapcore.DebugLevel
	}
	logger, err := newLogger(level)
	if err != nil {
		fmt.Fprintf(stderr, "sluice-agent check: logger: %v\n", err)
		return exitFailed
	}
	defer logger.Sync() //nolint:errcheck // stderr

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	res, err := agent.Check(ctx, cfg, logger.With(zap.String("command", "check")))
	if err != nil {
		fmt.Fprintf(stderr, "sluice-agent check: configuration: %v\n", err)
		return exitConfig
	}
	writeCheckReport(stdout, res)
	verdict := res.Err()
	switch {
	case verdict == nil:
		fmt.Fprintf(stdout, "ok: every node accepted every route\n")
		return 0
	case errors.Is(verdict, agent.ErrCheckUnreachable):
		fmt.Fprintf(stderr, "sluice-agent check: %v\n", verdict)
		return exitUnreachable
	default:
		fmt.Fprintf(stderr, "sluice-agent check: %v\n", verdict)
		return exitRejected
	}
}

// writeCheckReport prints each node's answer, a line per route.
func writeCheckReport(w io.Writer, res agent.CheckResult) {
	fmt.Fprintf(w, "checked as agent id %s\n", res.AgentID)
	for _, n := range res.Nodes {
		if n.Err != nil {
			fmt.Fprintf(w, "server %s: not reached: %v\n", n.Server, n.Err)
			continue
		}
		cred := n.Credential
		if cred == "" {
			cred = "(token)"
		}
		fmt.Fprintf(w, "node %s at %s (%s), credential %s: %d accepted, %d rejected\n",
			n.NodeID, n.Server, orUnknown(n.NodeBuild), cred, len(n.Accepted), len(n.Rejected))
		for _, name := range n.Accepted {
			fmt.Fprintf(w, "  accepted  %s\n", name)
		}
		for _, rj := range n.Rejected {
			name := rj.Name
			if rj.ListenPort != 0 && !strings.Contains(name, fmt.Sprint(rj.ListenPort)) {
				name = fmt.Sprintf("%s (listen_port %d)", name, rj.ListenPort)
			}
			fmt.Fprintf(w, "  rejected  %s: %s\n", name, rj.Reason)
		}
		for _, h := range n.HeldByAgent {
			fmt.Fprintf(w, "  held      %s: %s (the running agent of this id serves it)\n", h.Name, h.Reason)
		}
		for _, o := range n.Overlaps {
			shadowed := ""
			if o.Shadowed {
				shadowed = "; that agent comes first in routing order (this one is shadowed)"
			}
			fmt.Fprintf(w, "  overlap   %s: also served by agent %s of credential %s%s\n",
				o.Route, o.OtherAgentID, o.OtherCredential, shadowed)
		}
	}
}

func orUnknown(s string) string {
	if s == "" {
		return "build unknown"
	}
	return s
}

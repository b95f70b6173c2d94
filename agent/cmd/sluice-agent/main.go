// Command sluice-agent exposes local services through a sluice node: it dials
// out to the node over gRPC and serves the connections the node opens by
// dialing its configured upstreams. Run with -h for the flags.
//
// Commands:
//
//	sluice-agent [flags]          run the agent
//	sluice-agent check [flags]    check the configuration against the node, then exit (see check.go)
//	sluice-agent version          print the version and build information
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/sluice-tunnel/sluice/agent"
)

func main() {
	os.Exit(run(os.Args[1:]))
}

func run(args []string) int {
	if len(args) > 0 {
		switch args[0] {
		case "check":
			return runCheck(args[1:], os.Stdout, os.Stderr, os.Getenv)
		case "version":
			if len(args) > 1 {
				fmt.Fprintf(os.Stderr, "sluice-agent: version takes no arguments, got %q\n", args[1])
				return exitConfig
			}
			fmt.Print(versionText())
			return 0
		}
	}
	for _, a := range args {
		if a == "--" {
			break
		}
		if a == "-version" || a == "--version" {
			fmt.Print(versionText())
			return 0
		}
	}
	cfg, err := agent.ParseFlags(args, os.Getenv)
	if errors.Is(err, agent.ErrVersion) { // -version=true, say
		fmt.Print(versionText())
		return 0
	}
	if errors.Is(err, flag.ErrHelp) {
		fmt.Println(err.Error())
		fmt.Print(commandsHelp)
		return 0
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "sluice-agent: %v\n", err)
		return exitConfig
	}

	logger, err := newLogger(cfg.ZapLevel())
	if err != nil {
		fmt.Fprintf(os.Stderr, "sluice-agent: logger: %v\n", err)
		return exitFailed
	}
	defer logger.Sync() //nolint:errcheck // stderr

	sigs := make(chan os.Signal, 2)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	a, err := agent.New(cfg, logger)
	if err != nil {
		// New fails on the configuration alone (a CA or certificate file
		// that cannot be read): a restart would fail alike.
		logger.Error("invalid configuration", zap.Error(err))
		return exitConfig
	}
	logger.Info("starting", zap.String("build", agent.BuildString()), zap.String("agent_id", cfg.ID),
		zap.String("server", cfg.Server), zap.Int("upstreams", len(cfg.Upstreams)))
	runDone := make(chan error, 1)
	go func() { runDone <- a.Run(context.Background()) }()
	select {
	case err = <-runDone:
	case <-sigs:
		leave(a, sigs, cfg, logger)
		err = <-runDone
	}
	if err != nil {
		logger.Error("agent failed", zap.Error(err))
		return exitFailed
	}
	return 0
}

// leave stops the agent gracefully after a signal: the node routes it no
// new connections, and the open ones may finish within the shutdown grace,
// or until a second signal.
func leave(a *agent.Agent, sigs <-chan os.Signal, cfg *agent.Config, logger *zap.Logger) {
	logger.Info("shutting down", zap.String("grace", cfg.ShutdownGrace.String()))
	grace, cutNow := context.WithTimeout(context.Background(), cfg.ShutdownGrace)
	defer cutNow()
	go func() {
		select {
		case <-sigs:
			logger.Info("second signal: cutting the open connections now")
			cutNow()
		case <-grace.Done():
		}
	}()
	_ = a.Leave(grace)
}

// newLogger logs human-readable lines to stderr, like Caddy's console logs.
func newLogger(level zapcore.Level) (*zap.Logger, error) {
	zc := zap.NewProductionConfig()
	zc.Encoding = "console"
	zc.Level = zap.NewAtomicLevelAt(level)
	zc.EncoderConfig.EncodeTime = zapcore.ISO8601TimeEncoder
	zc.EncoderConfig.EncodeLevel = zapcore.CapitalLevelEncoder
	zc.DisableStacktrace = true
	zc.OutputPaths = []string{"stderr"}
	zc.ErrorOutputPaths = []string{"stderr"}
	return zc.Build()
}

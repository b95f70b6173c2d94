// Command listen is sluice's agent used as a Go library: the program serves
// its own http.Server through a sluice node (Caddy with the sluice modules)
// without opening a local port. agent.Listen connects to the node,
// advertises the host, and returns a net.Listener whose connections are the
// tunnel's; closing it withdraws the host.
//
// Run it against a node whose Caddyfile routes the host with the sluice
// directive (see Caddyfile.example):
//
//	SLUICE_SERVER=grpc://127.0.0.1:8001 SLUICE_TOKEN=... go run ./examples/listen -host app.localhost
//	curl -H 'Host: app.localhost' http://127.0.0.1/
//
// The connection settings come from the SLUICE_* variables sluice-agent
// reads (SLUICE_SERVER, SLUICE_TOKEN or SLUICE_TOKEN_FILE, SLUICE_CA_FILE...).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"net/http"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/coder/websocket"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/agent"
)

func main() {
	host := flag.String("host", "app.localhost", "the host name the node routes to this program")
	flag.Parse()
	log, err := zap.NewDevelopment()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
	if err := run(*host, log); err != nil {
		log.Fatal("listen example failed", zap.Error(err))
	}
}

func run(host string, log *zap.Logger) error {
	cfg := new(agent.Config)
	if err := cfg.ApplyEnv(nil); err != nil {
		return fmt.Errorf("environment: %w", err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()

	// The context bounds the connection only: Listen returns once the
	// node accepted the host, and the listener lives until closed.
	lctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	l, err := agent.Listen(lctx, cfg, agent.Upstream{Host: host}, agent.WithLogger(log))
	cancel()
	if err != nil {
		return err
	}
	log.Info("serving through the tunnel", zap.Stringer("routes", l.Addr()))

	srv := &http.Server{Handler: handler(), ReadHeaderTimeout: 10 * time.Second}
	stopped := make(chan struct{})
	go func() {
		defer close(stopped)
		<-ctx.Done()
		sctx, scancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer scancel()
		// Shutdown closes the listener, which withdraws the host at once,
		// and waits for the requests in flight; the agent leaves the node
		// once the last connection is closed.
		if err := srv.Shutdown(sctx); err != nil {
			log.Warn("requests cut at shutdown", zap.Error(err))
		}
		if err := l.Shutdown(sctx); err != nil {
			log.Warn("tunnel connections cut at shutdown", zap.Error(err))
		}
	}()
	if err := srv.Serve(l); !errors.Is(err, http.ErrServerClosed) {
		l.Close()
		return fmt.Errorf("serve: %w", err)
	}
	<-stopped
	return nil
}

// handler is the program's application: a greeting and a WebSocket echo.
func handler() http.Handler {
	mux := http.NewServeMux()
	mux.HandleFunc("/", func(w http.ResponseWriter, r *http.Request) {
		// RemoteAddr is the public client's address, as the node saw it.
		fmt.Fprintf(w, "hello, %s, from a program with no open port\n", r.RemoteAddr)
	})
	mux.HandleFunc("/ws", func(w http.ResponseWriter, r *http.Request) {
		c, err := websocket.Accept(w, r, nil)
		if err != nil {
			return
		}
		defer c.CloseNow()
		for {
			typ, msg, err := c.Read(r.Context())
			if err != nil {
				return
			}
			if err := c.Write(r.Context(), typ, msg); err != nil {
				return
			}
		}
	})
	return mux
}

package agent

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"go.uber.org/zap"
)

// Bounds of the admin listener: it answers small requests of monitoring
// systems, so slow or large ones are cut rather than held.
const (
	adminReadHeaderTimeout = 5 * time.Second
	adminWriteTimeout      = 30 * time.Second
	adminIdleTimeout       = 60 * time.Second
	adminMaxHeaderBytes    = 16 << 10
	// adminShutdownWait bounds how long Run waits for scrapes under way
	// when it returns.
	adminShutdownWait = time.Second
)

// AdminAddr returns the address the admin listener listens on (useful
// with admin_listen port 0), or nil while it does not.
func (a *Agent) AdminAddr() net.Addr {
	if addr := a.adminAddr.Load(); addr != nil {
		return addr
	}
	return nil
}

// startAdmin starts the admin listener of Config.AdminListen, if set; stop
// closes it, waiting a moment for the requests under way. It fails when
// the address cannot be bound: an agent asked to be observable that is
// not would go unnoticed until someone looks.
func (a *Agent) startAdmin() (stop func(), err error) {
	if a.cfg.AdminListen == "" {
		return func() {}, nil
	}
	ln, err := net.Listen("tcp", a.cfg.AdminListen)
	if err != nil {
		return nil, fmt.Errorf("admin_listen: %w", err)
	}
	if tcp, ok := ln.Addr().(*net.TCPAddr); ok {
		a.adminAddr.Store(tcp)
	}
	srv := &http.Server{
		Handler:           a.AdminHandler(),
		ReadHeaderTimeout: adminReadHeaderTimeout,
		WriteTimeout:      adminWriteTimeout,
		IdleTimeout:       adminIdleTimeout,
		MaxHeaderBytes:    adminMaxHeaderBytes,
		ErrorLog:          zap.NewStdLog(a.log.Named("admin")),
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		if err := srv.Serve(ln); !errors.Is(err, http.ErrServerClosed) {
			a.log.Error("admin listener failed", zap.Error(err))
		}
	}()
	a.log.Info("admin listener serving /metrics, /healthz, /readyz and /status", zap.String("admin_listen", ln.Addr().String()))
	return func() {
		ctx, cancel := context.WithTimeout(context.Background(), adminShutdownWait)
		defer cancel()
		if srv.Shutdown(ctx) != nil {
			srv.Close()
		}
		<-done
		a.adminAddr.Store(nil)
	}, nil
}

// AdminHandler serves what the admin listener serves: /metrics
// (Prometheus), /healthz, /readyz and /status (JSON). A program embedding
// the agent may mount it on a server of its own instead of setting
// Config.AdminListen.
func (a *Agent) AdminHandler() http.Handler {
	mux := http.NewServeMux()
	mux.Handle("GET /metrics", promhttp.HandlerFor(a.newRegistry(), promhttp.HandlerOpts{
		ErrorLog:      zap.NewStdLog(a.log.Named("admin")),
		ErrorHandling: promhttp.ContinueOnError,
	}))
	mux.HandleFunc("GET /healthz", func(w http.ResponseWriter, _ *http.Request) {
		writeText(w, http.StatusOK, "ok")
	})
	mux.HandleFunc("GET /readyz", a.serveReady)
	mux.HandleFunc("GET /status", a.serveStatus)
	return mux
}

// serveReady answers 200 while the agent is ready (Ready), else 503 with
// the reason, which a load balancer's log or a kubectl describe shows;
// either way followed by a line per node (readyDetail).
func (a *Agent) serveReady(w http.ResponseWriter, _ *http.Request) {
	detail := strings.TrimSuffix(a.readyDetail(), "\n")
	if detail != "" {
		detail = "\n" + detail
	}
	if ready, reason := a.Ready(); !ready {
		writeText(w, http.StatusServiceUnavailable, "not ready: "+reason+detail)
		return
	}
	writeText(w, http.StatusOK, "ready"+detail)
}

// serveStatus answers the agent's Status as indented JSON, for people as
// much as for scripts.
func (a *Agent) serveStatus(w http.ResponseWriter, _ *http.Request) {
	b, err := json.MarshalIndent(a.Status(), "", "  ")
	if err != nil {
		writeText(w, http.StatusInternalServerError, err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Header().Set("Cache-Control", "no-store")
	_, _ = w.Write(append(b, '\n'))
}

// writeText writes a one-line plain-text answer.
func writeText(w http.ResponseWriter, code int, msg string) {
	w.Header().Set("Content-Type", "text/plain; charset=utf-8")
	w.Header().Set("Cache-Control", "no-store")
	w.WriteHeader(code)
	_, _ = fmt.Fprintln(w, msg)
}

// warnAdminExposed warns when the admin listener binds beyond loopback:
// it answers without authentication, and /status names the agent's
// routes, targets and node.
func warnAdminExposed(log *zap.Logger, addr string) {
	if addr == "" || loopbackHost(addr) {
		return
	}
	log.Warn("admin_listen binds beyond loopback: /metrics and /status answer anyone who reaches it, without authentication; bind it to 127.0.0.1 or firewall it",
		zap.String("admin_listen", addr))
}

// loopbackHost reports whether the host of addr (host:port) is a loopback
// address or "localhost"; an empty host binds every interface.
func loopbackHost(addr string) bool {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return false
	}
	if host == "localhost" {
		return true
	}
	ip := net.ParseIP(host)
	return ip != nil && ip.IsLoopback()
}

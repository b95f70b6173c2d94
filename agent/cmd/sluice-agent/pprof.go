//go:build pprof

// Profiling builds (go build -tags pprof) serve net/http/pprof on the
// loopback address in SLUICE_PPROF_ADDR, for measuring the agent under load;
// release builds carry no debug listener.
package main

import (
	"net/http"
	_ "net/http/pprof" // registers the /debug/pprof handlers
	"os"
)

func init() {
	addr := os.Getenv("SLUICE_PPROF_ADDR")
	if addr == "" {
		return
	}
	go func() { _ = http.ListenAndServe(addr, nil) }()
}

package agent

import (
	"testing"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

// TestPlaintextTokenWarning: New warns once, at Warn, when the token would
// cross the network without TLS (grpc:// to a host that is not loopback),
// and stays quiet for a loopback node or a grpcs:// one.
func TestPlaintextTokenWarning(t *testing.T) {
	for _, tc := range []struct {
		server string
		warn   bool
	}{
		{"grpc://10.0.0.1:8001", true},
		{"grpc://192.0.2.7:8001", true},
		{"grpc://[2001:db8::1]:8001", true},
		{"grpc://node.example.com:8001", true},
		{"grpc://localhost.example.com:8001", true}, // DNS may point it anywhere
		{"grpc://127.0.0.1:8001", false},
		{"grpc://127.1.2.3:8001", false},
		{"grpc://[::1]:8001", false},
		{"grpc://[::ffff:127.0.0.1]:8001", false},
		{"grpc://localhost:8001", false},
		{"grpc://LOCALHOST.:8001", false},
		{"grpcs://10.0.0.1:8001", false},
		{"grpcs://node.example.com:8001", false},
	} {
		t.Run(tc.server, func(t *testing.T) {
			core, logs := observer.New(zap.InfoLevel)
			cfg := &Config{Server: tc.server, Token: "secret", ID: "agent-test",
				Upstreams: []Upstream{{Name: "echo", Target: "tcp://127.0.0.1:2"}}}
			if _, err := New(cfg, zap.New(core)); err != nil {
				t.Fatal(err)
			}
			warned := logs.FilterMessage(plaintextTokenMsg)
			want := 0
			if tc.warn {
				want = 1
			}
			if warned.Len() != want {
				t.Fatalf("logged %q %d times, want %d: %v", plaintextTokenMsg, warned.Len(), want, logs.All())
			}
			if want == 0 {
				return
			}
			e := warned.All()[0]
			if e.Level != zapcore.WarnLevel {
				t.Errorf("level %v, want warn", e.Level)
			}
			fields := e.ContextMap()
			if fields["server"] != tc.server {
				t.Errorf("server field %v, want %s", fields["server"], tc.server)
			}
			if fix, _ := fields["fix"].(string); fix == "" {
				t.Error("the warning says nothing of the fix")
			}
		})
	}
}

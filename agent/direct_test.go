package agent

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// TestDisableDirectSocketsLayers: disable_direct_sockets comes from the
// config file, the environment and the flag, in that order of precedence.
func TestDisableDirectSocketsLayers(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "agent.yaml")
	yaml := "server: grpc://n:1\ntoken: t\ndisable_direct_sockets: true\nupstreams:\n  - host: a\n    target: http://a:1\n"
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want bool
	}{
		{"file", []string{"-config", file}, nil, true},
		{"env over file", []string{"-config", file}, map[string]string{EnvDisableDirect: "false"}, false},
		{"flag over env", []string{"-config", file, "-disable-direct-sockets"}, map[string]string{EnvDisableDirect: "false"}, true},
		{"flag false over file", []string{"-config", file, "-disable-direct-sockets=false"}, nil, false},
		{"env alone", []string{"-server", "grpc://n:1", "-token", "t", "-upstream", "a=http://a:1"}, map[string]string{EnvDisableDirect: "1"}, true},
	} {
		c, err := ParseFlags(tc.args, envFunc(tc.env))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if c.DisableDirectSockets != tc.want {
			t.Errorf("%s: DisableDirectSockets %v, want %v", tc.name, c.DisableDirectSockets, tc.want)
		}
	}
	if _, err := ParseFlags([]string{"-server", "grpc://n:1", "-token", "t", "-upstream", "a=http://a:1"}, envFunc(map[string]string{EnvDisableDirect: "sometimes"})); err == nil {
		t.Errorf("bad %s accepted", EnvDisableDirect)
	}
}

// The usage's environment list names every variable.
func TestHelpListsDirectSocketsEnv(t *testing.T) {
	_, err := ParseFlags([]string{"-h"}, envFunc(nil))
	if !errors.Is(err, flag.ErrHelp) {
		t.Fatal(err)
	}
	u := err.Error()
	i := strings.Index(u, "SLUICE_CONFIG  SLUICE_SERVER")
	if i < 0 {
		t.Fatalf("no environment list in:\n%s", u)
	}
	list := u[i:]
	list = list[:strings.Index(list, "\n\n")]
	if !strings.Contains(list, EnvDisableDirect) {
		t.Fatalf("the environment list omits %s:\n%s", EnvDisableDirect, list)
	}
}

// TestPresentHelloAnswers: how the agent reads the node's answer to a
// direct socket's preface: 0x02 is the connection, not the path; a close
// is the path; no answer in time may be a socket the node took.
func TestPresentHelloAnswers(t *testing.T) {
	hello := tunnelpb.DirectHello("0123456789abcdef0123456789abcdef", 7)
	cases := []struct {
		name   string
		answer func(c net.Conn)
		check  func(err error) bool
	}{
		{"not open", func(c net.Conn) { c.Write([]byte{tunnelpb.DirectNotOpen}); c.Close() }, func(err error) bool {
			return errors.Is(err, tunnelcore.ErrNotDirect) && !errors.Is(err, tunnelcore.ErrPrefaceUnanswered)
		}},
		{"closed", func(c net.Conn) { c.Close() }, func(err error) bool {
			return err != nil && !errors.Is(err, tunnelcore.ErrNotDirect) && !errors.Is(err, tunnelcore.ErrPrefaceUnanswered)
		}},
		{"silent", func(c net.Conn) {}, func(err error) bool { return errors.Is(err, tunnelcore.ErrPrefaceUnanswered) }},
		{"accepted", func(c net.Conn) { c.Write([]byte{tunnelpb.LaneAccepted}) }, func(err error) bool { return err == nil }},
	}
	for _, tc := range cases {
		a, b := net.Pipe()
		go func() {
			io.ReadFull(b, make([]byte, len(hello)))
			tc.answer(b)
		}()
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		err := presentHello(ctx, a, hello)
		cancel()
		if !tc.check(err) {
			t.Errorf("%s: %v", tc.name, err)
		}
		a.Close()
		b.Close()
	}
}

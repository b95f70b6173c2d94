package agent

import (
	"context"
	"errors"
	"flag"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
	"github.com/sluice-tunnel/sluice/tunnelcore"
)

// The usage's environment list names every variable.
func TestHelpListsEveryEnvironmentVariable(t *testing.T) {
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
	for _, env := range []string{EnvConfig, EnvServer, EnvToken, EnvTokenFile, EnvID, EnvInsecure, EnvCAFile, EnvCertFile, EnvKeyFile,
		EnvLogLevel, EnvMaxConnections, EnvUpstreams, EnvTunnelBudget, EnvShutdownGrace, EnvDisableLane, EnvDisableDirect, EnvAdminListen,
		EnvServerEach, EnvServerRefresh} {
		if !strings.Contains(list, env) {
			t.Errorf("the environment list omits %s:\n%s", env, list)
		}
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

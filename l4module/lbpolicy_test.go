package l4module

import (
	"encoding/json"
	"net"
	"strings"
	"testing"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/mholt/caddy-l4/layer4"
	"go.uber.org/zap"

	"github.com/sluice-tunnel/sluice/caddymodule"
	"github.com/sluice-tunnel/sluice/internal/testnet"
)

// TestCaddyfileLBPolicyErrors: a wrong lb_policy fails the adapt naming
// the option and the valid values, as do a missing or extra argument and
// a repeated option.
func TestCaddyfileLBPolicyErrors(t *testing.T) {
	tests := []struct{ block, want string }{
		{"lb_policy fastest", `lb_policy: unknown policy "fastest" (want one of first, round_robin, random, least_conn)`},
		{"lb_policy", "wrong argument count"},
		{"lb_policy random first", "wrong argument count"},
		{"lb_policy random\n\t\t\t\t\tlb_policy first", "lb_policy given twice"},
		{"lb_polcy random", `unrecognized option "lb_polcy"`},
	}
	for _, tt := range tests {
		in := "{\n\tlayer4 {\n\t\t:5000 {\n\t\t\troute {\n\t\t\t\tsluice svc {\n\t\t\t\t\t" + tt.block + "\n\t\t\t\t}\n\t\t\t}\n\t\t}\n\t}\n}\n"
		_, _, err := caddyfile.Adapter{ServerType: httpcaddyfile.ServerType{}}.Adapt([]byte(in), nil)
		if err == nil || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%q: got %v, want an error with %q", tt.block, err, tt.want)
		}
	}
}

// TestProvisionRejectsUnknownLBPolicy: JSON config with a wrong lb_policy
// fails at load, naming the field, before the handler looks for the app.
func TestProvisionRejectsUnknownLBPolicy(t *testing.T) {
	var h Handler
	if err := json.Unmarshal([]byte(`{"route":"svc","lb_policy":"least_connections"}`), &h); err != nil {
		t.Fatal(err)
	}
	err := h.Provision(caddy.Context{})
	if err == nil || !strings.HasPrefix(err.Error(), `lb_policy: unknown policy "least_connections"`) {
		t.Fatalf("Provision = %v, want the lb_policy error", err)
	}
}

// TestHandlePassesThePolicy: the relay gets the handler's policy with
// every connection's target, the same one each time (the round-robin
// position is the handler's).
func TestHandlePassesThePolicy(t *testing.T) {
	lb, err := caddymodule.NewLBPolicy(caddymodule.LBRoundRobin)
	if err != nil {
		t.Fatal(err)
	}
	h, _ := testHandler("svc", nil)
	h.lb = lb
	var got []*caddymodule.LBPolicy
	h.relay = func(_ net.Conn, target caddymodule.TCPTarget) error {
		got = append(got, target.LB)
		return nil
	}
	for range 2 {
		_, server := testnet.TCPPair(t)
		if err := h.Handle(layer4.WrapConnection(server, nil, zap.NewNop()), nil); err != nil {
			t.Fatal(err)
		}
	}
	if len(got) != 2 || got[0] != lb || got[1] != lb {
		t.Fatalf("relayed with policies %v, want the handler's %p twice", got, lb)
	}
}

package caddymodule

import (
	"errors"
	"fmt"
	"net"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// UDPOptions are the sluice app's settings for UDP: the ports agents may
// claim for udp:// listen-port routes, and the bounds on datagram flows
// (proto/README §6.1). They are embedded in App, so their JSON keys sit
// beside the others.
type UDPOptions struct {
	// UDPPortRange is the list of UDP ports agents may claim with udp://
	// listen-port routes, in TCPPortRange's syntax ("16000-16099,17000":
	// ports and ranges, comma-separated, overlaps merged), as TCPPortRange
	// is for
	// tcp:// ones: the app binds each claimed port while its agent is
	// connected, and carries each client address's datagrams in a flow of
	// its own. The ranges are separate (UDP and TCP ports are separate
	// spaces: a route of each may claim one number, as a service speaking
	// both does). Unset: the app binds none, and udp:// listen-port routes
	// are served only by layer4 UDP servers of the config that route by
	// port.
	UDPPortRange string `json:"udp_port_range,omitempty"`

	// UDPBind is the host the claimed UDP ports bind on. Default: all
	// interfaces.
	UDPBind string `json:"udp_bind,omitempty"`

	// MaxUDPFlows bounds the datagram flows open at once, on the node's
	// ports and through layer4 UDP servers. A client address that would
	// take one past it has its datagrams dropped (counted) until a flow
	// ends. Each flow also holds a max_connections slot. Default 8192.
	MaxUDPFlows int `json:"max_udp_flows,omitempty"`

	// MaxUDPFlowsPerAddress bounds the flows of one client IP address (a
	// flow is one source address and port): a resolver that picks a new
	// source port per query, or a spray of spoofed ports, takes no more.
	// Default 1024.
	MaxUDPFlowsPerAddress int `json:"max_udp_flows_per_address,omitempty"`
}

// Defaults of UDPOptions.
const (
	DefaultMaxUDPFlows           = 8192
	DefaultMaxUDPFlowsPerAddress = 1024
)

// udpNodeOptions are the UDP settings the current config gives the node.
type udpNodeOptions struct {
	portRange       portRange // UDP ports agents may claim; zero: the node binds none
	bind            string    // host the claimed UDP ports bind on ("" = all)
	maxFlows        int
	maxFlowsPerAddr int
}

// provision checks the options and returns what the node takes from them.
func (u *UDPOptions) provision() (udpNodeOptions, error) {
	if u.MaxUDPFlows < 0 || u.MaxUDPFlowsPerAddress < 0 {
		return udpNodeOptions{}, errors.New("sluice: max_udp_flows and max_udp_flows_per_address must not be negative")
	}
	o := udpNodeOptions{bind: u.UDPBind, maxFlows: u.MaxUDPFlows, maxFlowsPerAddr: u.MaxUDPFlowsPerAddress}
	if o.maxFlows == 0 {
		o.maxFlows = DefaultMaxUDPFlows
	}
	if o.maxFlowsPerAddr == 0 {
		o.maxFlowsPerAddr = DefaultMaxUDPFlowsPerAddress
	}
	var err error
	if o.portRange, err = parsePortList("udp_port_range", u.UDPPortRange); err != nil {
		return udpNodeOptions{}, fmt.Errorf("sluice: %w", err)
	}
	if err := checkUDPBind(u.UDPBind, u.UDPPortRange); err != nil {
		return udpNodeOptions{}, err
	}
	return o, nil
}

// checkUDPBind refuses a udp_bind the claimed ports could not bind on, at
// load rather than at each agent's claim, and one without udp_port_range,
// where it binds nothing.
func checkUDPBind(bind, portRange string) error {
	if bind == "" {
		return nil
	}
	if portRange == "" {
		return fmt.Errorf("sluice: udp_bind: %q without udp_port_range binds nothing", bind)
	}
	pc, err := net.ListenPacket("udp", net.JoinHostPort(bind, "0"))
	if err != nil {
		return fmt.Errorf("sluice: udp_bind: %q: %w", bind, err)
	}
	return pc.Close()
}

// unmarshalUDPOption reads one of UDPOptions' Caddyfile options (the
// option name is d.Val()); ok is false for another option.
//
//	udp_port_range            <ports>...     # as tcp_port_range: 16000-16099,17000
//	udp_bind                  <host>
//	max_udp_flows             <n>
//	max_udp_flows_per_address <n>
func (u *UDPOptions) unmarshalUDPOption(d *caddyfile.Dispenser) (ok bool, err error) {
	switch d.Val() {
	case "udp_port_range":
		err = portListArg(d, &u.UDPPortRange)
	case "udp_bind":
		err = singleArg(d, &u.UDPBind)
	case "max_udp_flows":
		err = intArg(d, &u.MaxUDPFlows)
	case "max_udp_flows_per_address":
		err = intArg(d, &u.MaxUDPFlowsPerAddress)
	default:
		return false, nil
	}
	return true, err
}

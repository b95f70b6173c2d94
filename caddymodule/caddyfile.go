package caddymodule

import (
	"encoding/json"
	"fmt"
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/caddyserver/caddy/v2"
	"github.com/caddyserver/caddy/v2/caddyconfig"
	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/caddyserver/caddy/v2/caddyconfig/httpcaddyfile"
	"github.com/caddyserver/caddy/v2/modules/caddyhttp"
	"github.com/dustin/go-humanize"
	"golang.org/x/net/http/httpguts"
)

func init() {
	httpcaddyfile.RegisterGlobalOption("sluice", parseGlobalOption)
	httpcaddyfile.RegisterHandlerDirective("sluice", parseHandlerDirective)
	httpcaddyfile.RegisterDirectiveOrder("sluice", httpcaddyfile.After, "reverse_proxy")
}

// parseGlobalOption sets up the sluice app from the global options block.
// Several `sluice` blocks are merged. Syntax:
//
//	sluice {
//	    listen            <address>        # control plane, default :8001
//	    token             <token>          # the unscoped credential
//	    token_file        <path>
//	    tls               <cert_file> <key_file>   # serve grpcs://
//	    tls internal [<names>...] {          # or: a certificate from the client_auth CA
//	        lifetime <duration>              # default 7d, renewed at two thirds
//	    }
//
//	    # named credentials, each with what its agents may serve (see Scope)
//	    credential <name> {
//	        token           <token>          # or token_file <path>
//	        client_identity <uri-or-dns-name> # a client certificate's URI or DNS SAN
//	        hosts           <host|*.suffix|*>...
//	        server_names    <name|*.suffix|*>...  # TLS passthrough
//	        services        <name|*>...       # named TCP and UDP services
//	        ports           <ports>...        # listen ports (TCP and UDP), as tcp_port_range
//	        patterns                          # may advertise host patterns
//	        catch_all                         # may advertise the catch-all
//	        max_sessions    <n>
//	    }
//	    client_auth [<pki_ca_id>] {           # verify agents' client certificates (default CA local)
//	        require                           # refuse connections without one
//	        revoke <serial>...                # hex serials of revoked certificates
//	    }
//	    advertise_timeout <duration>
//	    tcp_port_range    <ports>...       # ports agents may claim (listen-port routes): ports
//	                                       # and lo-hi ranges, comma- or space-separated, as
//	                                       # 16000-16099,17000; overlaps are merged
//	    tcp_bind          <host>           # where claimed ports bind (default all)
//	    verbatim_idle_timeout <duration>   # close relayed TCP idle this long (default off)
//	    udp_port_range    <ports>...       # UDP ports agents may claim (udp:// listen-port routes),
//	                                       # in tcp_port_range's syntax
//	    udp_bind          <host>           # where claimed UDP ports bind (default all)
//	    max_udp_flows     <n>              # datagram flows open at once (default 8192)
//	    max_udp_flows_per_address <n>      # of one client IP (default 1024)
//
//	    # limits (defaults derive from the memory limit; see App)
//	    max_connections             <n>
//	    connection_memory           <size>   # e.g. 2GiB
//	    max_connections_per_address <n>
//	    tunnel_budget               <size>
//	    max_sessions                <n>
//	    max_sessions_per_address    <n>
//	    max_pending_streams         <n>
//	    max_pending_streams_per_address <n>
//	    tunnel_stall_timeout        <duration>
//	    drain_grace                 <duration>
//
//	    data_lane off                  # keep agents on the gRPC stream (proto/README §2.4)
//	    direct_sockets off             # keep bulk connections on the lane (proto/README §2.5)
//
//	    node_id <id>                   # the `node` label of the metrics and node_id of the logs (default the host name)
//	    warmup  <duration>             # readiness down this long after the control plane starts (default 0)
//	    cluster {                      # every agent connects to every member (needs node_id and a token)
//	        node <id> <url>            # grpc://host:port or grpcs://host:port; this node may omit its url
//	    }
//	}
func parseGlobalOption(d *caddyfile.Dispenser, existing any) (any, error) {
	app := new(App)
	if existing != nil {
		prev, ok := existing.(httpcaddyfile.App)
		if !ok {
			return nil, d.Errf("sluice: unexpected existing config of type %T", existing)
		}
		if err := json.Unmarshal(prev.Value, app); err != nil {
			return nil, d.Errf("sluice: %v", err)
		}
	}
	if err := app.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	return httpcaddyfile.App{Name: "sluice", Value: caddyconfig.JSON(app, nil)}, nil
}

// UnmarshalCaddyfile reads the global option block; see parseGlobalOption.
func (a *App) UnmarshalCaddyfile(d *caddyfile.Dispenser) error {
	d.Next() // option name
	if d.NextArg() {
		return d.ArgErr()
	}
	for d.NextBlock(0) {
		opt := d.Val()
		var err error
		switch opt {
		case "listen":
			err = singleArg(d, &a.Listen)
		case "token":
			err = singleArg(d, &a.Token)
		case "token_file":
			err = singleArg(d, &a.TokenFile)
		case "tls":
			err = a.unmarshalTLS(d)
		case "credential":
			err = a.unmarshalCredential(d)
		case "client_auth":
			err = a.unmarshalClientAuth(d)
		case "advertise_timeout":
			err = durationArg(d, &a.AdvertiseTimeout)
		case "verbatim_idle_timeout":
			err = durationArg(d, &a.VerbatimIdleTimeout)
		case "tcp_port_range":
			err = portListArg(d, &a.TCPPortRange)
		case "tcp_bind":
			err = singleArg(d, &a.TCPBind)
		case "max_connections":
			err = int64Arg(d, &a.MaxConnections)
		case "connection_memory":
			err = sizeArg(d, &a.ConnectionMemory)
		case "tunnel_budget":
			err = sizeArg(d, &a.TunnelBudget)
		case "max_connections_per_address":
			err = intArg(d, &a.MaxConnectionsPerAddress)
		case "max_sessions":
			err = intArg(d, &a.MaxSessions)
		case "max_sessions_per_address":
			err = intArg(d, &a.MaxSessionsPerAddress)
		case "max_pending_streams":
			err = intArg(d, &a.MaxPendingStreams)
		case "max_pending_streams_per_address":
			err = intArg(d, &a.MaxPendingStreamsPerAddress)
		case "tunnel_stall_timeout":
			err = durationArg(d, &a.TunnelStallTimeout)
		case "drain_grace":
			err = durationArg(d, &a.DrainGrace)
		case "data_lane":
			err = offArg(d, opt, &a.DisableDataLane)
		case "direct_sockets":
			err = offArg(d, opt, &a.DisableDirectSockets)
		case "node_id":
			err = singleArg(d, &a.NodeID)
		case "warmup":
			err = durationArg(d, &a.Warmup)
		case "cluster":
			err = a.unmarshalCluster(d)
		default:
			var ok bool
			if ok, err = a.UDPOptions.unmarshalUDPOption(d); !ok {
				return d.Errf("sluice: unrecognized option %q", opt)
			}
		}
		if err != nil {
			return err
		}
	}
	return nil
}

func singleArg(d *caddyfile.Dispenser, dst *string) error {
	opt := d.Val()
	if !d.NextArg() {
		return d.Errf("sluice: %s: missing value", opt)
	}
	*dst = d.Val()
	if d.NextArg() {
		return d.Errf("sluice: %s: takes one value", opt)
	}
	return nil
}

// portListArg reads the port list of option tcp_port_range or
// udp_port_range: one or more arguments, each a port, a lo-hi range or a
// comma-separated list of them ("16000-16099,17000" or "16000-16099
// 17000"), joined into the comma-separated JSON form.
func portListArg(d *caddyfile.Dispenser, dst *string) error {
	return portListArgAs(d, d.Val(), dst)
}

// portListArgAs is portListArg with what naming the option in its errors
// ("credential ops: ports"), for a port list inside a block.
func portListArgAs(d *caddyfile.Dispenser, what string, dst *string) error {
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Errf("sluice: %s: missing value", what)
	}
	list := strings.Join(args, ",")
	if _, err := parsePortList(what, list); err != nil {
		return d.Errf("sluice: %v", err)
	}
	*dst = list
	return nil
}

func durationArg(d *caddyfile.Dispenser, dst *caddy.Duration) error {
	opt := d.Val()
	var s string
	if err := singleArg(d, &s); err != nil {
		return err
	}
	dur, err := caddy.ParseDuration(s)
	if err != nil {
		return d.Errf("sluice: %s: %v", opt, err)
	}
	*dst = caddy.Duration(dur)
	return nil
}

// parseHandlerDirective sets up the sluice handler. It takes every
// reverse_proxy subdirective except upstreams. Syntax:
//
//	sluice [<matcher>] {
//	    lb_policy       <policy>         # default first (smallest agent id)
//	    lb_try_duration <duration>
//	    header_up       ...
//	    header_down     ...
//	    transport sluice {
//	        versions h2c                 # speak h2c to the agent's upstream
//	    }
//
//	    # stream policy (server-sent events, long polls)
//	    stream_response_content_types <media types...>|off  # default text/event-stream
//	    stream_request_accept_types   <media types...>|off  # default text/event-stream
//	    stream_path_prefixes          <prefixes...>
//	    max_request_time              <duration>           # ordinary exchanges; default none
//	    stream_max_request_time       <duration>           # streams and upgrades; default none
//	    stream_idle_timeout           <duration>           # silence between stream bytes
//
//	    response_header_timeout       <duration>|off       # wait for the response head; default 60s, then 504
//
//	    # client forwarding headers (see Handler)
//	    keep_forwarded_headers        # pass Forwarded and X-Real-IP from every client
//	    trusted_proxies <ranges...>   # reverse_proxy's: these keep them (and X-Forwarded-*)
//	    forward_headers <names...>    # allow-list: only these request headers cross (repeatable;
//	                                  # no names: none); Host, the body's Content-* and what
//	                                  # reverse_proxy and upgrades need always do (see Handler)
//
//	    ... (any other reverse_proxy subdirective)
//	}
//
// By default the Forwarded and X-Real-IP headers a client sent are removed
// before proxying unless the client is a trusted proxy (the server's
// trusted_proxies or the directive's), as reverse_proxy does for
// X-Forwarded-*. response_header_timeout 0 is off, as off is; it does not
// apply to stream_path_prefixes, and ends with the response head (see
// StreamPolicy.ResponseHeaderTimeout). Its name and meaning follow
// reverse_proxy's `transport http { response_header_timeout }`; the sluice
// transport takes that one too (unset by default), which bounds only the
// wait after the request is written, in every exchange, streams included.
func parseHandlerDirective(h httpcaddyfile.Helper) (caddyhttp.MiddlewareHandler, error) {
	d := h.Dispenser
	d.Next() // directive name
	if d.NextArg() {
		return nil, d.Errf("sluice: takes no arguments (agents are the upstreams), got %q", d.Val())
	}
	d.Reset()
	sh := new(Handler)
	if err := sh.StreamPolicy.unmarshalAndStrip(d); err != nil {
		return nil, err
	}
	d.Reset()
	if err := sh.unmarshalForwardingAndStrip(d); err != nil {
		return nil, err
	}
	d.Reset()
	if err := sh.Handler.UnmarshalCaddyfile(d); err != nil {
		return nil, err
	}
	if err := sh.Handler.FinalizeUnmarshalCaddyfile(h); err != nil {
		return nil, err
	}
	if len(sh.Upstreams) > 0 || sh.DynamicUpstreamsRaw != nil {
		return nil, d.Err("sluice: upstreams are the connected agents; remove `to`/`dynamic`")
	}
	if name, err := transportModule(sh.TransportRaw); err != nil || (name != "" && name != "sluice") {
		return nil, d.Err("sluice: transport: only `transport sluice { ... }` is allowed")
	}
	return sh, nil
}

// transportModule returns the name of the transport module of
// reverse_proxy's raw transport config ("" when none is set): its inline
// key, "protocol".
func transportModule(raw json.RawMessage) (string, error) {
	if raw == nil {
		return "", nil
	}
	var key struct {
		Protocol string `json:"protocol"`
	}
	if err := json.Unmarshal(raw, &key); err != nil {
		return "", fmt.Errorf("transport: %w", err)
	}
	return key.Protocol, nil
}

func int64Arg(d *caddyfile.Dispenser, dst *int64) error {
	opt := d.Val()
	var s string
	if err := singleArg(d, &s); err != nil {
		return err
	}
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil || v < 0 {
		return d.Errf("sluice: %s: %q is not a non-negative integer", opt, s)
	}
	*dst = v
	return nil
}

func intArg(d *caddyfile.Dispenser, dst *int) error {
	var v int64
	if err := int64Arg(d, &v); err != nil {
		return err
	}
	*dst = int(v)
	return nil
}

func sizeArg(d *caddyfile.Dispenser, dst *int64) error {
	opt := d.Val()
	var s string
	if err := singleArg(d, &s); err != nil {
		return err
	}
	v, err := humanize.ParseBytes(s)
	if err != nil || v > math.MaxInt64 {
		return d.Errf("sluice: %s: %q is not a size like 512MiB", opt, s)
	}
	*dst = int64(v)
	return nil
}

// unmarshalAndStrip reads the stream policy subdirectives of the `sluice`
// directive and deletes their tokens, so reverse_proxy's parser sees only
// its own.
func (p *StreamPolicy) unmarshalAndStrip(d *caddyfile.Dispenser) error {
	for d.Next() {
		for d.NextBlock(0) {
			if d.Nesting() != 1 {
				continue
			}
			opt := d.Val()
			var err error
			switch opt {
			case "stream_response_content_types", "stream_request_accept_types":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				if len(args) == 0 {
					return d.Errf("sluice: %s: want media types, or off", opt)
				}
				list := args
				if len(args) == 1 && args[0] == "off" {
					list = []string{}
				}
				if err := checkMediaTypes(list); err != nil {
					return d.Errf("sluice: %s: %v", opt, err)
				}
				if opt == "stream_response_content_types" {
					p.StreamResponseContentTypes = &list
				} else {
					p.StreamRequestAcceptTypes = &list
				}
			case "stream_path_prefixes":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				if len(args) == 0 {
					return d.Errf("sluice: %s: want path prefixes", opt)
				}
				p.StreamPathPrefixes = append(p.StreamPathPrefixes, args...)
			case "max_request_time", "stream_max_request_time", "stream_idle_timeout":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				if len(args) != 1 {
					return d.Errf("sluice: %s: want one duration", opt)
				}
				dur, perr := caddy.ParseDuration(args[0])
				if perr != nil || dur < 0 {
					return d.Errf("sluice: %s: %q is not a duration", opt, args[0])
				}
				switch opt {
				case "max_request_time":
					p.MaxRequestTime = caddy.Duration(dur)
				case "stream_max_request_time":
					p.StreamMaxRequestTime = caddy.Duration(dur)
				default:
					p.StreamIdleTimeout = caddy.Duration(dur)
				}
			case "response_header_timeout":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				if len(args) != 1 {
					return d.Errf("sluice: %s: want one duration, or off", opt)
				}
				var dur time.Duration
				if args[0] != "off" {
					var perr error
					if dur, perr = caddy.ParseDuration(args[0]); perr != nil || dur < 0 {
						return d.Errf("sluice: %s: %q is not a duration (or off)", opt, args[0])
					}
				}
				p.ResponseHeaderTimeout = new(caddy.Duration(dur))
			default:
				// reverse_proxy's: skip its arguments, which may read like
				// one of the options above (header_up X-Mode max_request_time).
				d.RemainingArgs()
			}
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// unmarshalForwardingAndStrip reads keep_forwarded_headers and
// forward_headers and deletes their tokens, so reverse_proxy's parser does
// not see them. forward_headers may repeat (the lists add up); with no
// names it lets none of the client's own headers cross.
func (h *Handler) unmarshalForwardingAndStrip(d *caddyfile.Dispenser) error {
	for d.Next() {
		for d.NextBlock(0) {
			if d.Nesting() != 1 {
				continue
			}
			switch d.Val() {
			case "keep_forwarded_headers":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				if len(args) != 0 {
					return d.Errf("sluice: keep_forwarded_headers: takes no value, got %q", args[0])
				}
				h.KeepForwardedHeaders = true
			case "forward_headers":
				args := d.RemainingArgs()
				d.DeleteN(len(args) + 1)
				for _, name := range args {
					if !httpguts.ValidHeaderFieldName(name) || strings.HasPrefix(name, ":") {
						return d.Errf("sluice: forward_headers: %q is not a header name", name)
					}
				}
				if h.ForwardHeaders == nil {
					h.ForwardHeaders = new([]string{})
				}
				*h.ForwardHeaders = append(*h.ForwardHeaders, args...)
			default:
				d.RemainingArgs() // reverse_proxy's, arguments and all
			}
		}
	}
	return nil
}

// offArg reads the on/off argument of option opt into off (true for off).
func offArg(d *caddyfile.Dispenser, opt string, off *bool) error {
	var v string
	if err := singleArg(d, &v); err != nil {
		return err
	}
	switch v {
	case "on":
		*off = false
	case "off":
		*off = true
	default:
		return d.Errf("sluice: %s: want on or off, got %q", opt, v)
	}
	return nil
}

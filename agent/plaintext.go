package agent

import (
	"net"
	"net/netip"
	"strings"

	"go.uber.org/zap"
)

// plaintextTokenMsg is the warning warnPlaintextToken logs.
const plaintextTokenMsg = "the token crosses the network in the clear: the node is grpc:// (plaintext) and not on this host"

// warnPlaintextToken warns, once for the agent's node address, when cfg
// sends its token without TLS to a node that may be elsewhere on the
// network: anyone on the path can read it and serve or hijack the node's
// routes as this agent. A loopback node is exempt (the token never leaves
// the host); a host name other than localhost is not, since DNS may point
// it anywhere. cfg must be validated.
func warnPlaintextToken(log *zap.Logger, cfg *Config) {
	useTLS, hostport := cfg.ServerAddr()
	if useTLS || hostport == "" {
		return
	}
	host, _, err := net.SplitHostPort(hostport)
	if err != nil || isLoopbackHost(host) {
		return
	}
	log.Warn(plaintextTokenMsg, zap.String("server", cfg.Server),
		zap.String("fix", "give the node's sluice block a certificate (tls <cert_file> <key_file>) and use grpcs://"+hostport+", with ca_file if the certificate is not publicly trusted"))
}

// isLoopbackHost reports whether host (no port, no brackets) names this
// machine for certain: localhost, or an address in 127.0.0.0/8 or ::1.
func isLoopbackHost(host string) bool {
	if strings.EqualFold(strings.TrimSuffix(host, "."), "localhost") {
		return true
	}
	host, _, _ = strings.Cut(host, "%") // a zone does not change the address
	ip, err := netip.ParseAddr(host)
	return err == nil && ip.Unmap().IsLoopback()
}

package caddymodule

import (
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
)

// unmarshalTLS reads `tls <cert_file> <key_file>` or `tls internal
// [<names>...] [{ lifetime <duration> }]` (see parseGlobalOption).
func (a *App) unmarshalTLS(d *caddyfile.Dispenser) error {
	args := d.RemainingArgs()
	if len(args) == 0 || args[0] != "internal" {
		if len(args) != 2 {
			return d.Errf("sluice: tls: want <cert_file> <key_file>, or internal [<names>...]")
		}
		a.TLSCertFile, a.TLSKeyFile = args[0], args[1]
		return nil
	}
	a.TLSInternal = &InternalTLS{Names: args[1:]}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "lifetime":
			if err := durationArg(d, &a.TLSInternal.Lifetime); err != nil {
				return err
			}
		default:
			return d.Errf("sluice: tls internal: unrecognized option %q", d.Val())
		}
	}
	return nil
}

// unmarshalCredential reads a `credential <name> { ... }` block (see
// parseGlobalOption).
func (a *App) unmarshalCredential(d *caddyfile.Dispenser) error {
	c := &Credential{}
	if err := singleArgOrBlock(d, &c.Name); err != nil {
		return err
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		opt := d.Val()
		var err error
		switch opt {
		case "token":
			err = singleArg(d, &c.Token)
		case "token_file":
			err = singleArg(d, &c.TokenFile)
		case "client_identity":
			err = singleArg(d, &c.ClientIdentity)
		case "hosts":
			err = listArg(d, &c.Scope.Hosts)
		case "server_names":
			err = listArg(d, &c.Scope.ServerNames)
		case "services":
			err = listArg(d, &c.Scope.Services)
		case "ports":
			// A list, as tcp_port_range: "16000-16099,17000" or
			// several arguments.
			err = portListArgAs(d, "credential "+c.Name+": ports", &c.Scope.Ports)
		case "patterns":
			err = flagArg(d, &c.Scope.AllowPatterns)
		case "catch_all":
			err = flagArg(d, &c.Scope.AllowCatchAll)
		case "max_sessions":
			err = intArg(d, &c.Scope.MaxSessions)
		default:
			return d.Errf("sluice: credential %s: unrecognized option %q", c.Name, opt)
		}
		if err != nil {
			return err
		}
	}
	a.Credentials = append(a.Credentials, c)
	return nil
}

// unmarshalClientAuth reads a `client_auth [<ca>] { ... }` block (see
// parseGlobalOption).
func (a *App) unmarshalClientAuth(d *caddyfile.Dispenser) error {
	if a.ClientAuth == nil {
		a.ClientAuth = &ClientAuth{}
	}
	ca := a.ClientAuth
	args := d.RemainingArgs()
	switch len(args) {
	case 0:
	case 1:
		ca.CA = args[0]
	default:
		return d.Errf("sluice: client_auth: takes at most one argument, the pki CA id")
	}
	for nesting := d.Nesting(); d.NextBlock(nesting); {
		switch d.Val() {
		case "require":
			if err := flagArg(d, &ca.Require); err != nil {
				return err
			}
		case "revoke":
			var serials []string
			if err := listArg(d, &serials); err != nil {
				return err
			}
			for _, s := range serials {
				if _, err := serialKeyOf(s); err != nil {
					return d.Errf("sluice: client_auth: revoke: %v", err)
				}
			}
			ca.RevokedSerials = append(ca.RevokedSerials, serials...)
		default:
			return d.Errf("sluice: client_auth: unrecognized option %q", d.Val())
		}
	}
	return nil
}

// singleArgOrBlock reads the one argument of an option that opens a block.
func singleArgOrBlock(d *caddyfile.Dispenser, dst *string) error {
	opt := d.Val()
	args := d.RemainingArgs()
	if len(args) != 1 {
		return d.Errf("sluice: %s: want one name, then a block", opt)
	}
	*dst = args[0]
	return nil
}

// listArg reads one or more values.
func listArg(d *caddyfile.Dispenser, dst *[]string) error {
	opt := d.Val()
	args := d.RemainingArgs()
	if len(args) == 0 {
		return d.Errf("sluice: %s: missing value", opt)
	}
	*dst = append(*dst, args...)
	return nil
}

// flagArg reads an option without a value that turns something on.
func flagArg(d *caddyfile.Dispenser, dst *bool) error {
	opt := d.Val()
	if d.NextArg() {
		return d.Errf("sluice: %s: takes no value, got %s", opt, strconv.Quote(d.Val()))
	}
	*dst = true
	return nil
}

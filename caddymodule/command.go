package caddymodule

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"

	tunnelpb "github.com/sluice-tunnel/sluice/proto"
)

func init() {
	caddycmd.RegisterCommand(caddycmd.Command{
		Name:  "sluice",
		Usage: "issue-cert --credential <name> [--name <name>] [--lifetime <duration>] [--out <dir>] [--force] [--address <admin> | --config <path> [--adapter <name>]] | version",
		Short: "Works with the sluice app of a running Caddy",
		Long: `
Works with the sluice app of a running Caddy through its admin API.

issue-cert issues a client certificate for an agent of a credential with a
client_identity, signed by the client_auth CA of the running config.

version prints the version of sluice built into this Caddy.`,
		CobraFunc: func(cmd *cobra.Command) {
			cmd.AddCommand(issueCertCommand())
			cmd.AddCommand(versionCommand())
		},
	})
}

// versionCommand is `caddy sluice version`: what `caddy version` is to
// Caddy, for the sluice modules of an xcaddy build. Its first line is the
// build the node sends agents in every AdvertiseAck (agents log it as
// node_build), so an operator matches one against the other.
func versionCommand() *cobra.Command {
	return &cobra.Command{
		Use:   "version",
		Short: "Prints the version of sluice built into this Caddy",
		Long: `
Prints the build line the node reports to agents ("sluice-node <version>
(<go version>)"), then from the binary's build info its main package, the
sluice module (with its checksum, or the local directory it was replaced
with by xcaddy --with), Caddy's and caddy-l4's modules and, for a build
from a checkout, the VCS revision.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			_, err := io.WriteString(cmd.OutOrStdout(), nodeVersionText())
			return err
		},
	}
}

// nodeVersionText is what `caddy sluice version` prints.
func nodeVersionText() string {
	return tunnelpb.VersionText("sluice-node", "", "github.com/caddyserver/caddy/v2", "github.com/mholt/caddy-l4")
}

// issueCertCommand is `caddy sluice issue-cert`.
func issueCertCommand() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "issue-cert --credential <name> [--name <name>] [--lifetime <duration>] [--out <dir>] [--force] [--address <admin> | --config <path> [--adapter <name>]]",
		Short: "Issues a client certificate for an agent of a sluice credential",
		Long: `
Issues a client certificate for an agent of a credential that has a
client_identity, signed by the client_auth CA of the running config's
sluice app, through the admin API (POST /sluice/certificates).

It writes <name>.crt (the certificate) and <name>.key (its key) with mode
0600, and ca.crt (the CA root agents trust, which also verifies a
tls_internal control plane), into --out (default: the current directory).
Give them to the agent as cert_file, key_file and ca_file. Existing files
are not overwritten unless --force is given (to renew an agent's
certificate in place: the agent reads the files again when it reconnects).

It prints the serial number (revoke it with client_auth's revoke), the
identity and the expiry.

The admin API is found like 'caddy reload' finds it: --address, else the
admin address of --config, else the default.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			cmd.SilenceUsage = true
			return runIssueCert(caddycmd.Flags{FlagSet: cmd.Flags()}, cmd.OutOrStdout())
		},
	}
	f := cmd.Flags()
	f.String("credential", "", "The credential the certificate authenticates as (required)")
	f.String("name", "", "The certificate's common name and file name (default: the credential's name)")
	f.String("lifetime", "", "How long the certificate is valid, e.g. 720h or 90d (default 30 days)")
	f.String("out", ".", "The directory to write <name>.crt, <name>.key and ca.crt into")
	f.Bool("force", false, "Overwrite existing files")
	f.String("address", "", "Address of the admin API (if --config is not used)")
	f.StringP("config", "c", "", "Configuration file to read the admin address from (if --address is not used)")
	f.StringP("adapter", "a", "", "Name of the config adapter (if --config is used)")
	return cmd
}

// issuedFiles are where issue-cert writes a certificate.
type issuedFiles struct{ cert, key, ca string }

func issuedFilesOf(dir, name string) issuedFiles {
	return issuedFiles{
		cert: filepath.Join(dir, name+".crt"),
		key:  filepath.Join(dir, name+".key"),
		ca:   filepath.Join(dir, "ca.crt"),
	}
}

// runIssueCert is issue-cert: it checks the flags and the files before it
// asks the admin API, so a refused run issues nothing.
func runIssueCert(fl caddycmd.Flags, stdout io.Writer) error {
	req := IssueRequest{Credential: fl.String("credential"), Name: fl.String("name"), Lifetime: fl.String("lifetime")}
	if req.Credential == "" {
		return errors.New("--credential is required")
	}
	name := cmp.Or(req.Name, req.Credential)
	if err := checkIssueName(name); err != nil {
		return fmt.Errorf("%w (give a file-safe one with --name)", err)
	}
	files := issuedFilesOf(cmp.Or(fl.String("out"), "."), name)
	force := fl.Bool("force")
	if !force {
		if err := refuseExisting(files.cert, files.key); err != nil {
			return err
		}
	}
	adminAddr, err := caddycmd.DetermineAdminAPIAddress(fl.String("address"), nil, fl.String("config"), fl.String("adapter"))
	if err != nil {
		return fmt.Errorf("couldn't determine admin API address: %w", err)
	}
	issued, err := requestCertificate(adminAddr, req)
	if err != nil {
		return err
	}
	if err := writeIssued(files, issued, force); err != nil {
		return err
	}
	fmt.Fprintf(stdout, "serial:      %s\nidentity:    %s\ncredential:  %s\nnot_after:   %s\ncertificate: %s\nkey:         %s\nca:          %s\n",
		issued.Serial, issued.Identity, issued.Credential, issued.NotAfter, files.cert, files.key, files.ca)
	return nil
}

// requestCertificate asks the admin API at adminAddr for a certificate.
func requestCertificate(adminAddr string, req IssueRequest) (*IssuedCertificate, error) {
	body, err := json.Marshal(req)
	if err != nil {
		return nil, err
	}
	resp, err := caddycmd.AdminAPIRequest(adminAddr, http.MethodPost, "/sluice/certificates", nil, bytes.NewReader(body))
	if err != nil {
		return nil, fmt.Errorf("issuing through the admin API at %s: %w", adminAddr, err)
	}
	defer resp.Body.Close()
	var out IssuedCertificate
	if err := json.NewDecoder(io.LimitReader(resp.Body, 1<<20)).Decode(&out); err != nil {
		return nil, fmt.Errorf("reading the admin API's answer: %w", err)
	}
	if out.Certificate == "" || out.Key == "" || out.CA == "" {
		return nil, errors.New("the admin API's answer lacks the certificate, key or CA")
	}
	return &out, nil
}

// refuseExisting fails when one of paths exists.
func refuseExisting(paths ...string) error {
	for _, p := range paths {
		if _, err := os.Lstat(p); err == nil {
			return fmt.Errorf("%s exists; use --force to overwrite it", p)
		} else if !errors.Is(err, fs.ErrNotExist) {
			return err
		}
	}
	return nil
}

// writeIssued writes the key, the certificate and the CA. ca.crt is shared
// by the certificates of one directory: one that holds the same CA is not
// in the way.
func writeIssued(files issuedFiles, issued *IssuedCertificate, force bool) error {
	if !force {
		if old, err := os.ReadFile(files.ca); err == nil && !bytes.Equal(old, []byte(issued.CA)) {
			return fmt.Errorf("%s holds another CA; use --force to overwrite it, or another --out", files.ca)
		}
	}
	for _, f := range []struct {
		path, data string
		perm       os.FileMode
	}{
		{files.key, issued.Key, 0o600},
		{files.cert, issued.Certificate, 0o600},
		{files.ca, issued.CA, 0o644},
	} {
		if err := writeFileAtomic(f.path, []byte(f.data), f.perm); err != nil {
			return err
		}
	}
	return nil
}

// writeFileAtomic replaces path with data in one rename, so an agent that
// reconnects while the files are renewed reads the old file or the new,
// never half of one.
func writeFileAtomic(path string, data []byte, perm os.FileMode) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(tmp.Name()) // after the rename: nothing
	if err := tmp.Chmod(perm); err != nil {
		tmp.Close()
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Sync(); err != nil {
		tmp.Close()
		return err
	}
	if err := tmp.Close(); err != nil {
		return err
	}
	return os.Rename(tmp.Name(), path)
}

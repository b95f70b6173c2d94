package agent

import (
	"bytes"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net/netip"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"

	"github.com/sluice-tunnel/sluice/internal/route"
)

func writeFile(t *testing.T, name, content string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(p, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func writeCA(t *testing.T) string {
	t.Helper()
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "test CA"},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(time.Hour),
		IsCA:                  true,
		BasicConstraintsValid: true,
		KeyUsage:              x509.KeyUsageCertSign,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, "ca.pem", string(pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})))
}

func envFunc(m map[string]string) func(string) string {
	return func(k string) string { return m[k] }
}

func TestLoadFileFull(t *testing.T) {
	ca := writeCA(t)
	tokenFile := writeFile(t, "token", "  s3cret\n\n")
	path := writeFile(t, "agent.yaml", `
server: grpcs://tunnel.example.com:7443
ca_file: `+ca+`
token_file: `+tokenFile+`
id: office-1
max_connections: 500
log_level: DEBUG
shutdown_grace: 45s
upstreams:
  - host: App.Example.COM
    target: http://127.0.0.1:3000
    rewrite_host: app.local
    force_http1: true
    allowed_cidrs: [10.0.0.0/8, "2001:db8::/32"]
  - name: api
    host_pattern: '[a-z]+\.api\.example\.com'
    target: HTTPS://10.0.0.5:8443/
    insecure_skip_verify: true
  - host: db.example.com
    target: tcp://127.0.0.1:5432
    tls_passthrough: true
    proxy_protocol: v1
  - listen_port: 16379
    target: tcp://[::1]:6379
    proxy_protocol: V2
    verbatim_idle_timeout: 90s
  - target: http://127.0.0.1:8080
`)
	c, err := LoadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if c.TokenFile != tokenFile || c.Token != "" {
		t.Fatalf("LoadFile must not read the token file: %+v", c)
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if tls, addr := c.ServerAddr(); !tls || addr != "tunnel.example.com:7443" {
		t.Errorf("ServerAddr = %v %q", tls, addr)
	}
	if c.Token != "s3cret" {
		t.Errorf("Token = %q", c.Token)
	}
	if c.ID != "office-1" || c.MaxConnections != 500 || c.LogLevel != "debug" || c.ZapLevel() != zapcore.DebugLevel {
		t.Errorf("id/max/log = %q %d %q", c.ID, c.MaxConnections, c.LogLevel)
	}
	if c.ShutdownGrace != 45*time.Second {
		t.Errorf("ShutdownGrace = %v", c.ShutdownGrace)
	}
	type want struct {
		name, scheme, hostport string
	}
	wants := []want{
		{"app.example.com", "http", "127.0.0.1:3000"},
		{"api", "https", "10.0.0.5:8443"},
		{"db.example.com", "tcp", "127.0.0.1:5432"},
		{":16379", "tcp", "[::1]:6379"},
		{"*", "http", "127.0.0.1:8080"},
	}
	if len(c.Upstreams) != len(wants) {
		t.Fatalf("%d upstreams", len(c.Upstreams))
	}
	for i, w := range wants {
		u := c.Upstreams[i]
		scheme, hp := u.TargetURL()
		if u.Name != w.name || scheme != w.scheme || hp != w.hostport {
			t.Errorf("upstreams[%d] = %q %q %q, want %v", i, u.Name, scheme, hp, w)
		}
	}
	u0 := c.Upstreams[0]
	if u0.Host != "app.example.com" || u0.RewriteHost != "app.local" || !u0.ForceHTTP1 {
		t.Errorf("upstreams[0] = %+v", u0)
	}
	if got := u0.Prefixes(); len(got) != 2 || got[1] != netip.MustParsePrefix("2001:db8::/32") {
		t.Errorf("Prefixes = %v", got)
	}
	u1 := c.Upstreams[1]
	if re := u1.Pattern(); re == nil || !re.MatchString("foo.api.example.com") || re.MatchString("x.foo.api.example.com.evil") {
		t.Errorf("Pattern = %v", re)
	}
	if u1.HostPattern != `[a-z]+\.api\.example\.com` || !u1.InsecureSkipVerify {
		t.Errorf("upstreams[1] = %+v", u1)
	}
	if u := c.Upstreams[2]; !u.TLSPassthrough || u.ProxyProtocol != "v1" || u.Pattern() != nil {
		t.Errorf("upstreams[2] = %+v", u)
	}
	if u := c.Upstreams[3]; u.ListenPort != 16379 || u.ProxyProtocol != "v2" || u.VerbatimIdleTimeout != 90*time.Second {
		t.Errorf("upstreams[3] = %+v", u)
	}
	if !c.Upstreams[4].IsCatchAll() || c.Upstreams[0].IsCatchAll() {
		t.Error("IsCatchAll")
	}
	// Validate is idempotent, including the token read from token_file.
	if err := c.Validate(); err != nil {
		t.Fatalf("second Validate: %v", err)
	}
	if c.Token != "s3cret" || c.ID != "office-1" {
		t.Errorf("after second Validate: %q %q", c.Token, c.ID)
	}
}

func TestLoadFileErrors(t *testing.T) {
	tests := []struct {
		name, yaml string
		want       []string
	}{
		{"unknown top-level field", "server: grpc://a:1\nservr: x\n", []string{"servr (line 2): unknown field"}},
		{"unknown upstream field", "upstreams:\n  - target: http://a:1\n    hots: a\n", []string{"upstreams[0].hots (line 3): unknown field"}},
		{"bad duration", "upstreams:\n  - verbatim_idle_timeout: soon\n", []string{"upstreams[0].verbatim_idle_timeout (line 2): `soon` is not a duration (as in 30s)"}},
		{"bare integer duration", "shutdown_grace: 30\n", []string{"shutdown_grace (line 1): `30` is not a duration"}},
		{"wrong type", "max_connections: many\n", []string{"max_connections (line 1): `many` is not an integer"}},
		{"every error, each with its field", "upstreams:\n  - host: a.test\n    target: http://a:1\n  - host: b.test\n    force_http1: maybe\n",
			[]string{"upstreams[1].force_http1 (line 5): `maybe` is not true or false"}},
		{"flow style: never the wrong field", "upstreams:\n  - {name: a, targt: x, target: \"tcp://a:1\", listen_port: 10000}\n", []string{"targt (line 2): unknown field"}},
		{"flow style: a type error keeps yaml's words", "{shutdown_grace: 30, log_level: debug}\n", []string{"line 1: cannot unmarshal !!int `30` into time.Duration"}},
		{"alias: yaml's words", "log_level: &g 30\nshutdown_grace: *g\n", []string{"line 1: cannot unmarshal"}},
		{"two documents", "server: grpc://a:1\n---\nserver: grpc://b:1\n", []string{"more than one YAML document"}},
		{"syntax", "server: [\n", []string{"yaml"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			path := writeFile(t, "agent.yaml", tt.yaml)
			_, err := LoadFile(path)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range append(tt.want, path) {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
	if _, err := LoadFile(filepath.Join(t.TempDir(), "missing.yaml")); err == nil || !strings.Contains(err.Error(), "missing.yaml") {
		t.Errorf("missing file: %v", err)
	}
	c, err := LoadFile(writeFile(t, "empty.yaml", "# nothing\n"))
	if err != nil || c == nil {
		t.Errorf("empty file: %v %v", c, err)
	}
}

func validConfig() *Config {
	return &Config{
		Server: "grpcs://tunnel.example.com:443",
		Token:  "t",
		Upstreams: []Upstream{
			{Host: "app.example.com", Target: "http://127.0.0.1:3000"},
			{Host: "db.example.com", Target: "tcp://127.0.0.1:5432", TLSPassthrough: true},
			{ListenPort: 16379, Target: "tcp://127.0.0.1:6379"},
		},
	}
}

func TestValidateOK(t *testing.T) {
	if err := validConfig().Validate(); err != nil {
		t.Fatal(err)
	}
}

func TestValidateErrors(t *testing.T) {
	ca := writeCA(t)
	notPEM := writeFile(t, "ca.txt", "hello")
	empty := writeFile(t, "token", " \n\t")
	latin := writeFile(t, "token", "\ufeffs\u00e9cret\n")
	up := func(c *Config) *Upstream { return &c.Upstreams[0] }
	tests := []struct {
		name   string
		mutate func(c *Config)
		want   string
	}{
		{"server required", func(c *Config) { c.Server = "" }, "server: required"},
		{"server scheme", func(c *Config) { c.Server = "https://a:443" }, `server: scheme "https" not supported`},
		{"server port", func(c *Config) { c.Server = "grpc://a" }, "server: \"grpc://a\": port required"},
		{"server path", func(c *Config) { c.Server = "grpc://a:1/x" }, `server: "grpc://a:1/x": path "/x" not allowed`},
		{"server no scheme", func(c *Config) { c.Server = "a:1" }, `server: "a:1" has no scheme (want grpc or grpcs, as in grpc://host:port)`},
		{"server IP without scheme", func(c *Config) { c.Server = "127.0.0.1:8001" }, `server: "127.0.0.1:8001" has no scheme`},
		{"target without scheme on a listen port", func(c *Config) { up(c).Target = "127.0.0.1:6379"; up(c).Host = ""; up(c).ListenPort = 16379 },
			"listen_port: requires a tcp:// target (a target without a scheme means http://)"},
		{"insecure with grpc", func(c *Config) { c.Server = "grpc://a:1"; c.Insecure = true }, "insecure: only valid with a grpcs:// server"},
		{"ca_file with grpc", func(c *Config) { c.Server = "grpc://a:1"; c.CAFile = ca }, "ca_file: only valid with a grpcs:// server"},
		{"ca_file and insecure", func(c *Config) { c.CAFile = ca; c.Insecure = true }, "ca_file: insecure and ca_file are mutually exclusive"},
		{"ca_file missing", func(c *Config) { c.CAFile = "/nonexistent/ca.pem" }, "ca_file: open /nonexistent/ca.pem"},
		{"ca_file not PEM", func(c *Config) { c.CAFile = notPEM }, "ca_file: " + notPEM + ": no PEM certificate"},
		{"token required", func(c *Config) { c.Token = "" }, "token: required"},
		{"shutdown_grace negative", func(c *Config) { c.ShutdownGrace = -time.Second }, "shutdown_grace: must be >= 0, got -1s"},
		{"token blank", func(c *Config) { c.Token = "  " }, "token: required"},
		{"token and token_file", func(c *Config) { c.TokenFile = empty }, "token and token_file are mutually exclusive"},
		{"token_file missing", func(c *Config) { c.Token = ""; c.TokenFile = "/nonexistent/token" }, "token_file: open /nonexistent/token"},
		{"token_file empty", func(c *Config) { c.Token = ""; c.TokenFile = empty }, "token_file: " + empty + " is empty"},
		{"id with space", func(c *Config) { c.ID = "a b" }, "id: "},
		{"id not ASCII", func(c *Config) { c.ID = "büro-1" }, `id: "büro-1": must be printable ASCII without spaces (found U+00FC at byte 1)`},
		{"id control", func(c *Config) { c.ID = "a\x7f" }, "id: "},
		{"token not ASCII", func(c *Config) { c.Token = "s\u00e9cret" }, "token: must be printable ASCII (found U+00E9 at byte 1)"},
		{"token with a tab", func(c *Config) { c.Token = "two\twords" }, "token: must be printable ASCII (found U+0009"},
		{"token with BOM inside", func(c *Config) { c.Token = "a\ufeffb" }, "token: must be printable ASCII (found U+FEFF"},
		{"id with a space", func(c *Config) { c.ID = "two words" }, "id: \"two words\": must be printable ASCII without spaces (found U+0020"},
		{"token_file not ASCII", func(c *Config) { c.Token = ""; c.TokenFile = latin },
			"token_file: " + latin + ": the token must be printable ASCII (found U+00E9 at byte 1)"},
		{"id too long", func(c *Config) { c.ID = strings.Repeat("x", 129) }, "id: longer than 128"},
		{"log_level", func(c *Config) { c.LogLevel = "verbose" }, `log_level: "verbose" not supported`},
		{"max_connections", func(c *Config) { c.MaxConnections = -1 }, "max_connections: must be >= 0"},
		{"no upstreams", func(c *Config) { c.Upstreams = nil }, "upstreams: at least one"},
		{"shutdown_grace past the node's cap", func(c *Config) { c.ShutdownGrace = 2 * time.Hour }, "shutdown_grace: at most 1h0m0s"},
		{"verbatim_idle_timeout on an http target", func(c *Config) { up(c).VerbatimIdleTimeout = time.Minute }, "upstreams[0].verbatim_idle_timeout: only valid with a tcp:// target"},
		{"name too long", func(c *Config) { up(c).Name = strings.Repeat("é", 129) }, "upstreams[0].name: name of 258 bytes: the node takes at most 256"},
		{"host_pattern too long for a name", func(c *Config) { up(c).Host, up(c).HostPattern = "", strings.Repeat("a", 257) }, "upstreams[0].name: name (host_pattern by default; set a shorter name) of 257 bytes"},
		{"target required", func(c *Config) { up(c).Target = "" }, "upstreams[0].target: required"},
		{"target scheme", func(c *Config) { up(c).Target = "ftp://a:21" }, `upstreams[0].target: scheme "ftp" not supported (want http, https, tcp or udp)`},
		{"udp without name or port", func(c *Config) { up(c).Host, up(c).Target = "", "udp://a:53" },
			`upstreams[0].target: a udp:// target needs a name other than "*" or a listen_port`},
		{"udp with host", func(c *Config) { up(c).Target = "udp://a:53" }, "upstreams[0].host: cannot be combined with a udp:// target"},
		{"udp passthrough", func(c *Config) { c.Upstreams[1].Target = "udp://a:53" }, "upstreams[1].tls_passthrough: cannot be combined with a udp:// target"},
		{"udp proxy_protocol", func(c *Config) { c.Upstreams[2].Target, c.Upstreams[2].ProxyProtocol = "udp://a:53", "v2" },
			"upstreams[2].proxy_protocol: only valid with a tcp:// target"},
		{"udp verbatim_idle_timeout", func(c *Config) { c.Upstreams[2].Target, c.Upstreams[2].VerbatimIdleTimeout = "udp://a:53", time.Second },
			"upstreams[2].verbatim_idle_timeout: only valid with a tcp:// target"},
		{"udp_idle_timeout on tcp", func(c *Config) { c.Upstreams[2].UDPIdleTimeout = time.Second }, "upstreams[2].udp_idle_timeout: only valid with a udp:// target"},
		{"udp_idle_timeout below 1ms", func(c *Config) { c.Upstreams[2].Target, c.Upstreams[2].UDPIdleTimeout = "udp://a:53", time.Microsecond },
			"upstreams[2].udp_idle_timeout: must be 0 or at least 1ms"},
		{"udp_idle_timeout negative", func(c *Config) { c.Upstreams[2].Target, c.Upstreams[2].UDPIdleTimeout = "udp://a:53", -time.Second },
			"upstreams[2].udp_idle_timeout: must be >= 0"},
		{"duplicate udp listen_port", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Name: "u1", ListenPort: 5353, Target: "udp://b:53"}, Upstream{Name: "u2", ListenPort: 5353, Target: "udp://b:54"})
		}, `upstreams[4]: udp listen_port 5353 already served by upstreams[3]`},
		{"target scheme checked first", func(c *Config) { up(c).Target = "ftp://a" }, `upstreams[0].target: scheme "ftp" not supported`},
		{"target empty scheme", func(c *Config) { up(c).Target = "//127.0.0.1:3000" }, "upstreams[0].target: \"//127.0.0.1:3000\" has no scheme"},
		{"target port", func(c *Config) { up(c).Target = "http://127.0.0.1" }, "upstreams[0].target: \"http://127.0.0.1\": port required"},
		{"target bad port", func(c *Config) { up(c).Target = "http://127.0.0.1:70000" }, "upstreams[0].target: "},
		{"target path", func(c *Config) { up(c).Target = "http://a:80/api" }, `upstreams[0].target: "http://a:80/api": path "/api" not allowed`},
		{"target query", func(c *Config) { up(c).Target = "http://a:80/?x=1" }, "upstreams[0].target: \"http://a:80/?x=1\": query not allowed"},
		{"target no host", func(c *Config) { up(c).Target = "http://:80" }, "upstreams[0].target: \"http://:80\" has no host"},
		{"target user", func(c *Config) { up(c).Target = "http://u:p@a:80" }, "upstreams[0].target: "},
		{"host with port", func(c *Config) { up(c).Host = "app.example.com:8080" }, "upstreams[0].host: \"app.example.com:8080\": no port allowed"},
		{"host wildcard", func(c *Config) { up(c).Host = "*.example.com" }, "upstreams[0].host: "},
		{"host empty label", func(c *Config) { up(c).Host = "a..b" }, "upstreams[0].host: "},
		{"host brackets around a name", func(c *Config) { up(c).Host = "[app.example.com]" }, `upstreams[0].host: "[app.example.com]": brackets are only allowed around an IPv6 address`},
		{"host brackets around IPv4", func(c *Config) { up(c).Host = "[10.0.0.1]" }, "upstreams[0].host: \"[10.0.0.1]\": brackets"},
		{"host IPv6 with port", func(c *Config) { up(c).Host = "[::1]:80" }, "upstreams[0].host: \"[::1]:80\": brackets are only allowed around an IPv6 address, without port"},
		{"host half bracket", func(c *Config) { up(c).Host = "::1]" }, "upstreams[0].host: "},
		{"host and host_pattern", func(c *Config) { up(c).HostPattern = "a" }, "upstreams[0].host_pattern: host and host_pattern are mutually exclusive"},
		{"host_pattern compile", func(c *Config) { up(c).Host = ""; up(c).HostPattern = "a(" }, "upstreams[0].host_pattern: error parsing regexp"},
		{"host_pattern upper case", func(c *Config) { up(c).Host = ""; up(c).HostPattern = `App\.example\.com` },
			`upstreams[0].host_pattern: "App\\.example\\.com" matches 'A' literally, but hosts are matched lower-cased`},
		{"host_pattern escaping its anchors", func(c *Config) { up(c).Host = ""; up(c).HostPattern = `never\.example)|(.*` }, "upstreams[0].host_pattern: error parsing regexp"},
		{"host_pattern too complex", func(c *Config) { up(c).Host = ""; up(c).HostPattern = `(?:.*a){1000}` }, "upstreams[0].host_pattern: too complex"},
		{"host label too long", func(c *Config) { up(c).Host = strings.Repeat("a", 64) + ".com" }, "label longer than 63 bytes"},
		{"insecure_skip_verify http", func(c *Config) { up(c).InsecureSkipVerify = true }, "upstreams[0].insecure_skip_verify: only valid with an https:// target"},
		{"tls_passthrough no host", func(c *Config) { c.Upstreams[1].Host = "" }, "upstreams[1].tls_passthrough: requires host or host_pattern"},
		{"tls_passthrough http", func(c *Config) { c.Upstreams[1].Target = "http://a:1" }, "upstreams[1].tls_passthrough: requires a tcp:// target"},
		{"listen_port range", func(c *Config) { c.Upstreams[2].ListenPort = 70000 }, "upstreams[2].listen_port: 70000 out of range 1..65535"},
		{"listen_port negative", func(c *Config) { c.Upstreams[2].ListenPort = -1 }, "upstreams[2].listen_port: -1 out of range"},
		{"listen_port http", func(c *Config) { c.Upstreams[2].Target = "http://a:1" }, "upstreams[2].listen_port: requires a tcp:// target"},
		{"listen_port host", func(c *Config) { c.Upstreams[2].Host = "a.example.com" }, "upstreams[2].listen_port: cannot be combined with host"},
		{"listen_port host_pattern", func(c *Config) { c.Upstreams[2].HostPattern = "a" }, "upstreams[2].listen_port: cannot be combined with host_pattern"},
		{"listen_port tls_passthrough", func(c *Config) { c.Upstreams[1].ListenPort = 2000 }, "upstreams[1].listen_port: cannot be combined with tls_passthrough"},
		{"proxy_protocol value", func(c *Config) { c.Upstreams[2].ProxyProtocol = "v3" }, `upstreams[2].proxy_protocol: "v3" not supported`},
		{"proxy_protocol http", func(c *Config) { up(c).ProxyProtocol = "v2" }, "upstreams[0].proxy_protocol: only valid with a tcp:// target"},
		{"force_http1 listen_port", func(c *Config) { c.Upstreams[2].ForceHTTP1 = true }, "upstreams[2].force_http1: only valid on a route that takes HTTP"},
		{"force_http1 tls_passthrough", func(c *Config) { c.Upstreams[1].ForceHTTP1 = true }, "upstreams[1].force_http1: only valid on a route that takes HTTP"},
		{"rewrite_host listen_port", func(c *Config) { c.Upstreams[2].RewriteHost = "x" }, "upstreams[2].rewrite_host: only valid on a route that takes HTTP"},
		{"rewrite_host named tcp service", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Name: "pg", Target: "tcp://127.0.0.1:5432", RewriteHost: "x"})
		}, "upstreams[3].rewrite_host: only valid on a route that takes HTTP"},
		{"rewrite_host space", func(c *Config) { up(c).RewriteHost = "a b" }, "upstreams[0].rewrite_host: "},
		{"allowed_cidrs", func(c *Config) { up(c).AllowedCIDRs = []string{"10.0.0.0/8", "10.0.0.300/8"} }, "upstreams[0].allowed_cidrs[1]: "},
		{"allowed_cidrs bare address", func(c *Config) { up(c).AllowedCIDRs = []string{"10.0.0.1"} }, "upstreams[0].allowed_cidrs[0]: "},
		{"verbatim_idle_timeout negative", func(c *Config) { c.Upstreams[2].VerbatimIdleTimeout = -time.Second }, "upstreams[2].verbatim_idle_timeout: must be >= 0"},
		{"verbatim_idle_timeout below 1ms", func(c *Config) { c.Upstreams[2].VerbatimIdleTimeout = 500 * time.Microsecond },
			"upstreams[2].verbatim_idle_timeout: must be 0 or at least 1ms, got 500µs"},
		{"verbatim_idle_timeout 1ns", func(c *Config) { c.Upstreams[2].VerbatimIdleTimeout = 1 }, "upstreams[2].verbatim_idle_timeout: must be 0 or at least 1ms"},
		{"verbatim_idle_timeout huge", func(c *Config) { c.Upstreams[2].VerbatimIdleTimeout = 2000 * time.Hour }, "upstreams[2].verbatim_idle_timeout: must be at most"},
		{"duplicate name", func(c *Config) { c.Upstreams[2].Name = "app.example.com" }, `upstreams[2].name: duplicate name "app.example.com" (also upstreams[0];`},
		{"duplicate default name", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Host: "APP.example.com", Target: "http://b:1"})
		}, `upstreams[3].name: duplicate name "app.example.com" (also upstreams[0];`},
		{"duplicate host", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Name: "other", Host: "app.example.com", Target: "http://b:1"})
		}, `upstreams[3]: host "app.example.com" already served by upstreams[0]`},
		{"duplicate listen_port", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Name: "other", ListenPort: 16379, Target: "tcp://b:1"})
		}, "upstreams[3]: listen_port 16379 already served by upstreams[2]"},
		{"two catch-alls", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Target: "http://a:1"}, Upstream{Name: "b", Target: "http://b:1"})
		}, "upstreams[4]: catch-all already served by upstreams[3]"},
		{"hostless tcp upstream without a name", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Target: "tcp://127.0.0.1:6379"})
		}, "upstreams[3].name: a tcp:// upstream without host, host_pattern or listen_port is a service reached by its name"},
		{"more upstreams than a node takes", func(c *Config) {
			for i := range 1025 {
				c.Upstreams = append(c.Upstreams, Upstream{Host: fmt.Sprintf("h%d.example.com", i), Target: "http://127.0.0.1:3000"})
			}
		}, "upstreams: at most 1024 (a node takes no more routes from one agent), got 1028"},
		{"host patterns larger together than a node takes", func(c *Config) {
			for i := range 11 { // ~1,900 instructions each
				c.Upstreams = append(c.Upstreams, Upstream{HostPattern: fmt.Sprintf("a{950}c{950}b%d", i), Target: "http://127.0.0.1:3000"})
			}
		}, "upstreams[13].host_pattern: the host patterns up to this one compile to"},
		{"named tcp catch-all", func(c *Config) {
			c.Upstreams = append(c.Upstreams, Upstream{Host: "*", Name: "tls", Target: "tcp://127.0.0.1:8443"})
		}, `upstreams[3].name: a tcp:// catch-all (host '*') is named "*"; remove name "tls"`},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c := validConfig()
			tt.mutate(c)
			err := c.Validate()
			if err == nil {
				t.Fatal("no error")
			}
			if !strings.Contains(err.Error(), tt.want) {
				t.Errorf("error %q\ndoes not contain %q", err, tt.want)
			}
		})
	}
}

func TestValidateJoinsErrors(t *testing.T) {
	c := &Config{Upstreams: []Upstream{{Target: "ftp://a:1"}, {Target: ""}}}
	err := c.Validate()
	for _, w := range []string{"server: required", "token: required", "upstreams[0].target: scheme", "upstreams[1].target: required"} {
		if err == nil || !strings.Contains(err.Error(), w) {
			t.Errorf("error %v does not contain %q", err, w)
		}
	}
}

// TestTCPRoutesThatTakeHTTPTakeItsOptions: a tcp:// route reached by host
// (Caddy speaks HTTP, or TLS, to it) takes force_http1 and rewrite_host,
// which the node applies to every HTTP route.
func TestTCPRoutesThatTakeHTTPTakeItsOptions(t *testing.T) {
	c := validConfig()
	c.Upstreams = append(c.Upstreams,
		Upstream{Host: "legacy.example.com", Target: "tcp://127.0.0.1:8080", ForceHTTP1: true, RewriteHost: "legacy.internal"},
		Upstream{Host: "*", Target: "tcp://127.0.0.1:8081", ForceHTTP1: true})
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
}

// TestIPv4MappedCIDRsAreUnmapped: client addresses are compared unmapped,
// so an IPv4-mapped prefix is stored as the IPv4 prefix it covers.
func TestIPv4MappedCIDRsAreUnmapped(t *testing.T) {
	c := validConfig()
	c.Upstreams[0].AllowedCIDRs = []string{"::ffff:10.0.0.0/104", "::ffff:192.0.2.7/128", "2001:db8::/32"}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	want := []string{"10.0.0.0/8", "192.0.2.7/32", "2001:db8::/32"}
	if got := c.Upstreams[0].AllowedCIDRs; !slices.Equal(got, want) {
		t.Fatalf("allowed_cidrs %q, want %q", got, want)
	}
}

func TestValidateNormalises(t *testing.T) {
	c := &Config{
		Server:   "  GRPC://Tunnel:80 ",
		Token:    " tok\n",
		LogLevel: "Warn",
		Upstreams: []Upstream{
			{Host: "Web.Example.com.", Target: "http://a:1"},
			{Host: "*", Target: "http://b:1"},
			{HostPattern: `.*\.svc`, Target: "http://c:1"},
			{ListenPort: 22, Target: "TCP://d:22", ProxyProtocol: "V1"},
		},
	}
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if tls, addr := c.ServerAddr(); tls || addr != "Tunnel:80" {
		t.Errorf("ServerAddr = %v %q", tls, addr)
	}
	if c.Token != "tok" || c.LogLevel != "warn" || c.ZapLevel() != zapcore.WarnLevel {
		t.Errorf("token %q level %q", c.Token, c.LogLevel)
	}
	names := []string{"web.example.com", "*", `.*\.svc`, ":22"}
	for i, n := range names {
		if c.Upstreams[i].Name != n {
			t.Errorf("upstreams[%d].Name = %q, want %q", i, c.Upstreams[i].Name, n)
		}
	}
	if c.Upstreams[0].Host != "web.example.com" || c.Upstreams[1].Host != "" || !c.Upstreams[1].IsCatchAll() {
		t.Errorf("hosts %q %q", c.Upstreams[0].Host, c.Upstreams[1].Host)
	}
	if s, _ := c.Upstreams[3].TargetURL(); s != "tcp" || c.Upstreams[3].ProxyProtocol != "v1" {
		t.Errorf("upstreams[3] %q %q", s, c.Upstreams[3].ProxyProtocol)
	}
	if (&Config{}).ZapLevel() != zapcore.InfoLevel {
		t.Error("default ZapLevel")
	}
}

// What Validate leaves in the exported fields is what advertise sends the
// node, which reads it without the agent's normalisation.
func TestValidateStoresNormalisedValues(t *testing.T) {
	c := validConfig()
	c.Upstreams = []Upstream{
		{Host: "db.example.com", Target: " TCP://127.0.0.1:5432/", TLSPassthrough: true},
		{Host: "[::1]", Target: "HTTPS://[::1]:8443"},
		{Host: "[FE80::1]", Target: "Http://Web.Local:80"},
		{ListenPort: 16379, Target: "tcp://127.0.0.1:6379", VerbatimIdleTimeout: time.Millisecond,
			AllowedCIDRs: []string{" 10.0.0.0/8", "2001:DB8::/32 ", "192.168.1.7/24"}},
		{HostPattern: `(?i)App\.example\.com`, Target: "http://127.0.0.1:3001"},
		{HostPattern: `[a-z]+\.example\.com`, Target: "http://127.0.0.1:3002"},
	}
	for round := range 2 { // a second Validate keeps the values
		if err := c.Validate(); err != nil {
			t.Fatalf("round %d: %v", round, err)
		}
		ups := c.Upstreams
		for i, want := range []string{"tcp://127.0.0.1:5432", "https://[::1]:8443", "http://Web.Local:80"} {
			if ups[i].Target != want {
				t.Errorf("round %d: upstreams[%d].Target = %q, want %q", round, i, ups[i].Target, want)
			}
		}
		if ups[1].Host != "::1" || ups[1].Name != "::1" || ups[2].Host != "fe80::1" {
			t.Errorf("round %d: hosts %q (name %q) %q", round, ups[1].Host, ups[1].Name, ups[2].Host)
		}
		if want := []string{"10.0.0.0/8", "2001:db8::/32", "192.168.1.7/24"}; !slices.Equal(ups[3].AllowedCIDRs, want) {
			t.Errorf("round %d: allowed_cidrs %q, want %q", round, ups[3].AllowedCIDRs, want)
		}
		if len(ups[3].Prefixes()) != 3 || ups[3].VerbatimIdleTimeout != time.Millisecond {
			t.Errorf("round %d: prefixes %v timeout %v", round, ups[3].Prefixes(), ups[3].VerbatimIdleTimeout)
		}
		if re := ups[4].Pattern(); re == nil || !re.MatchString("app.example.com") {
			t.Errorf("round %d: (?i) pattern %v", round, re)
		}
	}
}

func TestDefaultID(t *testing.T) {
	re := regexp.MustCompile(`^agent-[0-9a-f]{12}$`)
	seen := map[string]bool{}
	for range 20 {
		c := validConfig()
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if !re.MatchString(c.ID) {
			t.Fatalf("ID %q", c.ID)
		}
		if seen[c.ID] {
			t.Fatalf("ID %q repeated", c.ID)
		}
		seen[c.ID] = true
		id := c.ID
		if err := c.Validate(); err != nil || c.ID != id {
			t.Fatalf("second Validate changed ID %q -> %q (%v)", id, c.ID, err)
		}
	}
}

func TestTokenFile(t *testing.T) {
	c := validConfig()
	c.Token = ""
	c.TokenFile = writeFile(t, "token", "\n\t abc.def \r\n")
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Token != "abc.def" {
		t.Fatalf("Token = %q", c.Token)
	}
	// A token set after validation conflicts again.
	c.Token = "other"
	if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "token and token_file are mutually exclusive") {
		t.Fatalf("err = %v", err)
	}
}

// Editors on Windows start text files with a byte order mark, which is not
// white space and would make every metadata value invalid.
func TestTokenByteOrderMark(t *testing.T) {
	c := validConfig()
	c.Token = ""
	c.TokenFile = writeFile(t, "token", "\ufeffabc.def\r\n")
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Token != "abc.def" {
		t.Fatalf("Token from file = %q", c.Token)
	}
	c = validConfig()
	c.Token = "\ufeff tok "
	if err := c.Validate(); err != nil {
		t.Fatal(err)
	}
	if c.Token != "tok" {
		t.Fatalf("Token = %q", c.Token)
	}
}

func TestTokenErrorDoesNotShowToken(t *testing.T) {
	c := validConfig()
	c.Token = "secret-\u00e9-value"
	err := c.Validate()
	if err == nil || strings.Contains(err.Error(), "secret") {
		t.Fatalf("err = %v", err)
	}
}

func TestApplyEnv(t *testing.T) {
	tokenFile := writeFile(t, "token", "from-file")
	base := func() *Config {
		return &Config{
			Server:         "grpc://file:1",
			Token:          "file-token",
			ID:             "file-id",
			LogLevel:       "error",
			MaxConnections: 10,
			Insecure:       true,
			Upstreams:      []Upstream{{Host: "file.example.com", Target: "http://a:1"}},
		}
	}
	t.Run("empty environment keeps file values", func(t *testing.T) {
		c := base()
		if err := c.ApplyEnv(envFunc(nil)); err != nil {
			t.Fatal(err)
		}
		if c.Server != "grpc://file:1" || c.Token != "file-token" || c.ID != "file-id" || !c.Insecure || len(c.Upstreams) != 1 {
			t.Errorf("%+v", c)
		}
	})
	t.Run("environment overrides", func(t *testing.T) {
		c := base()
		err := c.ApplyEnv(envFunc(map[string]string{
			EnvServer:         "grpcs://env:2",
			EnvTokenFile:      tokenFile,
			EnvID:             "env-id",
			EnvInsecure:       "false",
			EnvCAFile:         "/ca.pem",
			EnvLogLevel:       "debug",
			EnvMaxConnections: "20",
			EnvShutdownGrace:  "2m",
			EnvUpstreams:      "env.example.com=http://b:2 ; ;listen_port=2222,target=tcp://c:22;",
		}))
		if err != nil {
			t.Fatal(err)
		}
		if c.Server != "grpcs://env:2" || c.ID != "env-id" || c.Insecure || c.CAFile != "/ca.pem" ||
			c.LogLevel != "debug" || c.MaxConnections != 20 || c.ShutdownGrace != 2*time.Minute {
			t.Errorf("%+v", c)
		}
		if c.Token != "" || c.TokenFile != tokenFile {
			t.Errorf("token %q file %q: SLUICE_TOKEN_FILE must replace the file's token", c.Token, c.TokenFile)
		}
		if len(c.Upstreams) != 3 || c.Upstreams[1].Host != "env.example.com" || c.Upstreams[2].ListenPort != 2222 {
			t.Errorf("upstreams %+v", c.Upstreams)
		}
	})
	t.Run("token replaces token_file", func(t *testing.T) {
		c := &Config{TokenFile: tokenFile}
		if err := c.ApplyEnv(envFunc(map[string]string{EnvToken: "env"})); err != nil {
			t.Fatal(err)
		}
		if c.Token != "env" || c.TokenFile != "" {
			t.Errorf("token %q file %q", c.Token, c.TokenFile)
		}
	})
	t.Run("both token variables conflict", func(t *testing.T) {
		c := validConfig()
		if err := c.ApplyEnv(envFunc(map[string]string{EnvToken: "x", EnvTokenFile: tokenFile})); err != nil {
			t.Fatal(err)
		}
		if err := c.Validate(); err == nil || !strings.Contains(err.Error(), "mutually exclusive") {
			t.Errorf("err = %v", err)
		}
	})
	for _, tt := range []struct{ env, val, want string }{
		{EnvInsecure, "maybe", `SLUICE_INSECURE: invalid boolean "maybe"`},
		{EnvMaxConnections, "lots", `SLUICE_MAX_CONNECTIONS: invalid integer "lots"`},
		{EnvUpstreams, "bogus=1,target=http://a:1;host=a,colour=red,target=http://a:1", `SLUICE_UPSTREAMS: upstream spec "host=a,colour=red,target=http://a:1": unknown key "colour"`},
	} {
		t.Run(tt.env, func(t *testing.T) {
			err := base().ApplyEnv(envFunc(map[string]string{tt.env: tt.val}))
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Errorf("err = %v, want %q", err, tt.want)
			}
		})
	}
}

// TestValidateAcceptsWhatTheNodeServes: patterns with escapes, classes and
// named groups, and tokens with inner spaces (printable ASCII, as gRPC
// metadata allows) pass; Validate rejects only what could never work.
func TestValidateAcceptsWhatTheNodeServes(t *testing.T) {
	for _, p := range []string{`\S+\.example\.com`, `\D+\.example\.com`, `\pL+\.example\.com`, `(?P<sub>[a-z]+)\.example\.com`, `(?i)App\.example\.com`} {
		c := validConfig()
		c.Upstreams[0].Host, c.Upstreams[0].HostPattern = "", p
		if err := c.Validate(); err != nil {
			t.Errorf("host_pattern %q: %v", p, err)
		}
	}
	c := validConfig()
	c.Token = "correct horse battery staple"
	if err := c.Validate(); err != nil {
		t.Errorf("a token with inner spaces: %v", err)
	}
}

// TestNamedTCPServicesAreNotCatchAlls: tcp:// upstreams with a name and no
// host, pattern or port are services reached by name; several may sit
// beside the HTTP catch-all.
func TestNamedTCPServicesAreNotCatchAlls(t *testing.T) {
	for _, catchAll := range []Upstream{
		{Host: "*", Target: "http://127.0.0.1:8080"},
		// Caddy speaking TLS to the upstream through the agent (the
		// transport's tls) needs a tcp:// catch-all.
		{Host: "*", Target: "tcp://127.0.0.1:8443"},
	} {
		c := validConfig()
		c.Upstreams = append(c.Upstreams,
			Upstream{Name: "redis", Target: "tcp://127.0.0.1:6379"},
			Upstream{Name: "pg", Target: "TCP://127.0.0.1:5432"},
			catchAll)
		if err := c.Validate(); err != nil {
			t.Fatal(err)
		}
		if err := c.Validate(); err != nil { // normalised values validate again
			t.Fatal(err)
		}
		n := len(c.Upstreams)
		if c.Upstreams[n-3].IsCatchAll() || c.Upstreams[n-2].IsCatchAll() || !c.Upstreams[n-1].IsCatchAll() {
			t.Fatalf("named tcp:// services taken for the catch-all, or %s not", catchAll.Target)
		}
	}
}

// FuzzParseConfig: no YAML makes the config reader panic, and an error
// that names a field names one of the document's (explainYAML never
// invents a path).
func FuzzParseConfig(f *testing.F) {
	for _, s := range []string{
		"server: grpc://a:1\nshutdown_grace: 30\n",
		"upstreams:\n  - host: a\n    targt: x\n  - {name: b, target: 'tcp://b:1', listen_port: oops}\n",
		"log_level: &g 30\nshutdown_grace: *g\n",
		"<<: {a: 1}\nupstreams: [1, [2], {x: y}]\n",
		"? [a, b]\n: c\n",
		"max_connections: many\nservr: x\n",
	} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		_, err := parseConfig(data)
		if err == nil {
			return
		}
		// "path (line N): ..." names a field the document has.
		msg := err.Error()
		if i := strings.Index(msg, " (line "); i > 0 && !strings.Contains(msg[:i], " ") && !strings.Contains(msg[:i], ";") {
			last := msg[:i]
			if j := strings.LastIndexAny(last, ".]"); j >= 0 {
				last = last[j+1:]
			}
			if last != "" && !bytes.Contains(data, []byte(last)) {
				t.Fatalf("error %q names %q, which the document does not have", msg, last)
			}
		}
	})
}

// TestAdvertisedRoutesClassifyAsValidated: for upstreams of every kind,
// written as -upstream specs, the kind Validate decided (which its checks
// switch on: route keys, the HTTP options) is the kind route.Classify
// gives the route the agent advertises, which is the node's. An agent
// deciding a kind on its own, or advertising fields other than it
// classified, fails here.
func TestAdvertisedRoutesClassifyAsValidated(t *testing.T) {
	specs := map[route.Kind]string{
		route.Host:               "app.example.com=http://127.0.0.1:3000",
		route.HostPattern:        `host_pattern=.*\.apps\.example\.com,target=https://127.0.0.1:8443`,
		route.CatchAll:           "*=http://127.0.0.1:3001",
		route.TCPHost:            "legacy.example.com=tcp://127.0.0.1:8080,force_http1",
		route.TCPHostPattern:     `host_pattern=.*\.legacy\.example\.com,target=tcp://127.0.0.1:8081`,
		route.PassthroughHost:    "db.example.com=tcp://127.0.0.1:5432,tls_passthrough",
		route.PassthroughPattern: `host_pattern=.*\.db\.example\.com,target=tcp://127.0.0.1:5433,tls_passthrough`,
		route.NamedTCP:           "name=redis,target=tcp://127.0.0.1:6379",
		route.ListenPort:         "listen_port=16379,target=tcp://127.0.0.1:6380",
		route.NamedUDP:           "name=dns,target=udp://127.0.0.1:53,udp_idle_timeout=30s",
		// The same number as the TCP one: a port number is one port of each.
		route.UDPListenPort: "name=dns-port,listen_port=16379,target=udp://127.0.0.1:5353",
	}
	var ups []Upstream
	var want []route.Kind
	for _, k := range route.Kinds() {
		spec, ok := specs[k]
		if !ok {
			t.Errorf("kind %v: no upstream here; give it one", k)
			continue
		}
		u, err := ParseUpstream(spec)
		if err != nil {
			t.Fatal(err)
		}
		ups, want = append(ups, u), append(want, k)
	}
	a, err := New(testConfig("127.0.0.1:1", "secret", ups...), zap.NewNop())
	if err != nil {
		t.Fatal(err)
	}
	routes := a.advertise().GetAdvertise().GetRoutes()
	if len(routes) != len(want) {
		t.Fatalf("advertised %d routes for %d upstreams", len(routes), len(want))
	}
	for i, rt := range routes {
		u := a.cfg.Upstreams[i]
		got, err := route.Classify(rt)
		if err != nil || got != want[i] || u.Kind() != want[i] {
			t.Errorf("%s: validated as %v, advertised as %v (%v); want %v", specs[want[i]], u.Kind(), got, err, want[i])
		}
		if got == route.NamedUDP && rt.GetUdpIdleTimeoutMs() != 30000 {
			t.Errorf("%s: advertised udp_idle_timeout_ms %d, want 30000", specs[want[i]], rt.GetUdpIdleTimeoutMs())
		}
		if u.IsCatchAll() != (got == route.CatchAll) || u.IsNamedService() != (got == route.NamedTCP) {
			t.Errorf("%s: IsCatchAll %v, IsNamedService %v for a %v route", specs[want[i]], u.IsCatchAll(), u.IsNamedService(), got)
		}
	}
}

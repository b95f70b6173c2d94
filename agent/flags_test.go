package agent

import (
	"errors"
	"flag"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestParseUpstream(t *testing.T) {
	tests := []struct {
		spec string
		want Upstream
	}{
		{"host=app.example.com,target=http://127.0.0.1:3000",
			Upstream{Host: "app.example.com", Target: "http://127.0.0.1:3000"}},
		{"app.example.com=http://127.0.0.1:3000",
			Upstream{Host: "app.example.com", Target: "http://127.0.0.1:3000"}},
		{"app.example.com=http://127.0.0.1:3000,rewrite_host=app.local,force_http1",
			Upstream{Host: "app.example.com", Target: "http://127.0.0.1:3000", RewriteHost: "app.local", ForceHTTP1: true}},
		{"*=http://127.0.0.1:8080",
			Upstream{Host: "*", Target: "http://127.0.0.1:8080"}},
		{"*=tcp://127.0.0.1:6379",
			Upstream{Host: "*", Target: "tcp://127.0.0.1:6379"}},
		{"target=http://127.0.0.1:8080,name=fallback",
			Upstream{Name: "fallback", Target: "http://127.0.0.1:8080"}},
		{" host = db.example.com , target = tcp://127.0.0.1:5432 , tls_passthrough , proxy_protocol=v2 ",
			Upstream{Host: "db.example.com", Target: "tcp://127.0.0.1:5432", TLSPassthrough: true, ProxyProtocol: "v2"}},
		{"listen_port=16379,target=tcp://127.0.0.1:6379,verbatim_idle_timeout=1m30s,allowed_cidrs=10.0.0.0/8 192.168.0.0/16,allowed_cidrs=::1/128",
			Upstream{ListenPort: 16379, Target: "tcp://127.0.0.1:6379", VerbatimIdleTimeout: 90 * time.Second,
				AllowedCIDRs: []string{"10.0.0.0/8", "192.168.0.0/16", "::1/128"}}},
		{"host-pattern=[a-z]{1,3}\\.example\\.com,target=https://10.0.0.5:8443,insecure-skip-verify=true,force_http1=false",
			Upstream{HostPattern: `[a-z]{1,3}\.example\.com`, Target: "https://10.0.0.5:8443", InsecureSkipVerify: true}},
		{"target=http://a:1,host_pattern=(a|b){2,}x",
			Upstream{HostPattern: "(a|b){2,}x", Target: "http://a:1"}},
		{"target=http://a:1,host=a,", Upstream{Host: "a", Target: "http://a:1"}},
		{`host_pattern=[a-z]{1,3}\.example\.com,insecure_skip_verify,target=https://a:1`,
			Upstream{HostPattern: `[a-z]{1,3}\.example\.com`, Target: "https://a:1", InsecureSkipVerify: true}},
		{`target=http://a:1,host_pattern=[x,y]{2,}\.example\.com`,
			Upstream{HostPattern: `[x,y]{2,}\.example\.com`, Target: "http://a:1"}},
	}
	for _, tt := range tests {
		t.Run(tt.spec, func(t *testing.T) {
			got, err := ParseUpstream(tt.spec)
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, tt.want) {
				t.Errorf("got  %+v\nwant %+v", got, tt.want)
			}
		})
	}
}

func TestParseUpstreamErrors(t *testing.T) {
	tests := []struct{ spec, want string }{
		{"", "empty"},
		{"host=a", "target missing"},
		{"host=a,target=http://a:1,colour=red", `unknown key "colour"`},
		{"app.example.com", `"app.example.com" is not key=value`},
		{"host=a,target=http://a:1,target=http://b:1", "target given twice"},
		{"a=http://a:1,host=b", "host given twice"},
		{"target=http://a:1,host", "host needs a value"},
		{"target=tcp://a:1,listen_port=redis", `listen_port: invalid port "redis"`},
		{"target=tcp://a:1,tls_passthrough=yes please", "tls_passthrough: invalid boolean"},
		{"target=tcp://a:1,verbatim_idle_timeout=30", `verbatim_idle_timeout: invalid duration "30"`},
		{"=http://a:1", "empty host"},
		// A mistyped key after host_pattern is not part of the pattern.
		{`target=https://127.0.0.1:8443,host_pattern=[a-z]+\.dev\.example\.com,rewrite_hots=dev.internal`, `unknown key "rewrite_hots"`},
		{`host_pattern=a{1,3},target=https://a:1,insecure_skip_verfy`, `unknown key "insecure_skip_verfy"`},
		{`target=http://a:1,host_pattern=[a-z]{1,3},Force-HTTP2`, `unknown key "Force-HTTP2"`},
		{`target=http://a:1,host_pattern=a{1,3},x=y`, `unknown key "x"`},
		{`target=http://a:1,host_pattern=a{1,3},3}=y`, `unknown key "3}"`},
		{`target=http://a:1,host=a,tls_pasthrough`, `unknown key "tls_pasthrough"`},
		// A mistyped first key is not a short-form host.
		{`hst=app.test,target=http://a:1`, `unknown key "hst" (in the short form HOST=TARGET, the target has a scheme`},
	}
	for _, tt := range tests {
		t.Run(tt.spec, func(t *testing.T) {
			_, err := ParseUpstream(tt.spec)
			if err == nil || !strings.Contains(err.Error(), tt.want) {
				t.Fatalf("err = %v, want %q", err, tt.want)
			}
			if !strings.Contains(err.Error(), "upstream spec") {
				t.Errorf("err %q does not name the spec", err)
			}
		})
	}
}

func TestParseFlagsPrecedence(t *testing.T) {
	tokenFile := writeFile(t, "token", "file-token\n")
	cfg := writeFile(t, "agent.yaml", `
server: grpc://file:1
token: yaml-token
id: file-id
log_level: error
max_connections: 10
upstreams:
  - host: file.example.com
    target: http://127.0.0.1:1
`)
	env := map[string]string{
		EnvConfig:    cfg,
		EnvServer:    "grpc://env:2",
		EnvID:        "env-id",
		EnvLogLevel:  "warn",
		EnvUpstreams: "env.example.com=http://127.0.0.1:2",
	}
	tests := []struct {
		name  string
		args  []string
		check func(t *testing.T, c *Config)
	}{
		{"file and env", nil, func(t *testing.T, c *Config) {
			if c.Server != "grpc://env:2" || c.ID != "env-id" || c.LogLevel != "warn" || c.MaxConnections != 10 || c.Token != "yaml-token" {
				t.Errorf("%+v", c)
			}
			if len(c.Upstreams) != 2 || c.Upstreams[0].Name != "file.example.com" || c.Upstreams[1].Name != "env.example.com" {
				t.Errorf("upstreams %+v", c.Upstreams)
			}
		}},
		{"flags override", []string{
			"-server", "grpcs://flag:3", "-id=flag-id", "-log-level", "debug", "-max-connections", "0",
			"-token-file", tokenFile, "-insecure",
			"-upstream", "*=http://127.0.0.1:3", "-upstream", "listen_port=2222,target=tcp://127.0.0.1:22",
		}, func(t *testing.T, c *Config) {
			if tls, addr := c.ServerAddr(); !tls || addr != "flag:3" || !c.Insecure {
				t.Errorf("server %v %q insecure %v", tls, addr, c.Insecure)
			}
			if c.ID != "flag-id" || c.LogLevel != "debug" || c.MaxConnections != 0 {
				t.Errorf("%+v", c)
			}
			if c.Token != "file-token" || c.TokenFile != tokenFile {
				t.Errorf("token %q file %q", c.Token, c.TokenFile)
			}
			var names []string
			for _, u := range c.Upstreams {
				names = append(names, u.Name)
			}
			if want := []string{"file.example.com", "env.example.com", "*", ":2222"}; !reflect.DeepEqual(names, want) {
				t.Errorf("names %q, want %q", names, want)
			}
		}},
		{"-config overrides SLUICE_CONFIG", []string{"-config", writeFile(t, "other.yaml", "token: other\nupstreams: [{target: 'http://a:1'}]\n")},
			func(t *testing.T, c *Config) {
				if c.Token != "other" || c.Server != "grpc://env:2" || c.MaxConnections != 0 || len(c.Upstreams) != 2 {
					t.Errorf("%+v", c)
				}
			}},
		{"-token replaces token", []string{"-token", " flag-token "}, func(t *testing.T, c *Config) {
			if c.Token != "flag-token" {
				t.Errorf("token %q", c.Token)
			}
		}},
		{"shutdown grace default", nil, func(t *testing.T, c *Config) {
			if c.ShutdownGrace != DefaultShutdownGrace {
				t.Errorf("ShutdownGrace %v, want the default %v", c.ShutdownGrace, DefaultShutdownGrace)
			}
		}},
		{"-shutdown-grace", []string{"-shutdown-grace", "90s"}, func(t *testing.T, c *Config) {
			if c.ShutdownGrace != 90*time.Second {
				t.Errorf("ShutdownGrace %v", c.ShutdownGrace)
			}
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseFlags(tt.args, envFunc(env))
			if err != nil {
				t.Fatal(err)
			}
			tt.check(t, c)
		})
	}
}

func TestParseFlagsInsecureFalseOverridesEnv(t *testing.T) {
	env := map[string]string{EnvServer: "grpcs://a:1", EnvToken: "t", EnvInsecure: "true", EnvUpstreams: "a=http://a:1"}
	c, err := ParseFlags([]string{"-insecure=false"}, envFunc(env))
	if err != nil {
		t.Fatal(err)
	}
	if c.Insecure {
		t.Error("insecure still set")
	}
}

// TestServerTrustIsLayeredLikeTheToken: a layer that sets one of insecure
// and ca_file replaces the other of the layers below, and one that makes
// the server grpc:// drops their trust settings; only what one layer sets
// together conflicts.
func TestServerTrustIsLayeredLikeTheToken(t *testing.T) {
	ca := writeCA(t)
	file := func(trust string) string {
		return writeFile(t, "agent.yaml", "server: grpcs://a:1\ntoken: t\nupstreams:\n  - host: a\n    target: http://a:1\n"+trust)
	}
	for _, tc := range []struct {
		name         string
		trust        string
		env          map[string]string
		args         []string
		wantInsecure bool
		wantCA       string
		wantErr      string
	}{
		{"flag ca_file over file insecure", "insecure: true\n", nil, []string{"-ca-file", ca}, false, ca, ""},
		{"env ca_file over file insecure", "insecure: true\n", map[string]string{EnvCAFile: ca}, nil, false, ca, ""},
		{"flag insecure over env ca_file", "", map[string]string{EnvCAFile: ca}, []string{"-insecure"}, true, "", ""},
		{"insecure=false keeps ca_file", "ca_file: " + ca + "\n", nil, []string{"-insecure=false"}, false, ca, ""},
		{"-ca-file= clears ca_file", "ca_file: " + ca + "\n", nil, []string{"-ca-file="}, false, "", ""},
		{"plaintext server drops file trust", "insecure: true\nca_file: " + ca + "\n", map[string]string{EnvServer: "grpc://b:2"}, nil, false, "", ""},
		{"one layer sets both", "", nil, []string{"-insecure", "-ca-file", ca}, false, "", "insecure and ca_file are mutually exclusive"},
		{"one layer sets plaintext and insecure", "", nil, []string{"-server", "grpc://b:2", "-insecure"}, false, "", "insecure: only valid with a grpcs:// server"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			env := map[string]string{EnvConfig: file(tc.trust)}
			for k, v := range tc.env {
				env[k] = v
			}
			c, err := ParseFlags(tc.args, envFunc(env))
			if err == nil {
				err = c.Validate()
			}
			if tc.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tc.wantErr) {
					t.Fatalf("err %v, want %q", err, tc.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if c.Insecure != tc.wantInsecure || c.CAFile != tc.wantCA {
				t.Errorf("insecure %v ca_file %q, want %v %q", c.Insecure, c.CAFile, tc.wantInsecure, tc.wantCA)
			}
		})
	}
}

func TestParseFlagsErrors(t *testing.T) {
	env := map[string]string{EnvServer: "grpc://a:1", EnvToken: "t"}
	tests := []struct {
		name string
		args []string
		env  map[string]string
		want []string
	}{
		{"unknown flag", []string{"-bogus"}, env, []string{"flag provided but not defined: -bogus", "-h"}},
		{"bad int", []string{"-max-connections", "x"}, env, []string{"max-connections"}},
		{"positional", []string{"-upstream", "a=http://a:1", "extra"}, env, []string{`unexpected argument "extra"`}},
		{"bad spec", []string{"-upstream", "host=a"}, env, []string{"-upstream: upstream spec \"host=a\": target missing"}},
		{"validation", []string{"-upstream", "a=ftp://a:1", "-upstream", "b=http://b:1,listen_port=80"}, env,
			[]string{`-upstream[0].target: scheme "ftp"`, "-upstream[1].listen_port: requires a tcp:// target"}},
		{"no upstreams", nil, env, []string{"upstreams: at least one"}},
		{"missing server", []string{"-upstream", "a=http://a:1"}, map[string]string{EnvToken: "t"}, []string{"server: required"}},
		{"missing config file", nil, map[string]string{EnvConfig: "/nonexistent/agent.yaml"}, []string{"/nonexistent/agent.yaml"}},
		{"bad env", []string{"-max-connections", "3"}, map[string]string{EnvMaxConnections: "x"}, []string{"SLUICE_MAX_CONNECTIONS"}},
		{"bad grace env", nil, map[string]string{EnvShutdownGrace: "10"}, []string{`SLUICE_SHUTDOWN_GRACE: invalid duration "10"`}},
		{"bad grace flag", []string{"-shutdown-grace", "soon"}, env, []string{"shutdown-grace"}},
		{"bad data lane env", nil, map[string]string{EnvDisableLane: "sometimes"}, []string{`SLUICE_DISABLE_DATA_LANE: invalid boolean "sometimes"`}},
		{"negative grace", []string{"-shutdown-grace", "-1s", "-upstream", "a=http://a:1"}, env, []string{"shutdown_grace: must be >= 0"}},
		{"id not ASCII", []string{"-id", "büro", "-upstream", "a=http://a:1"}, env, []string{`id: "büro": must be printable ASCII`}},
		{"token not ASCII", []string{"-token", "s\u00e9cret", "-upstream", "a=http://a:1"}, env, []string{"token: must be printable ASCII"}},
		{"token flags conflict", []string{"-token", "a", "-token-file", "/x", "-upstream", "a=http://a:1"}, env,
			[]string{"token and token_file are mutually exclusive"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := ParseFlags(tt.args, envFunc(tt.env))
			if err == nil {
				t.Fatalf("no error, config %+v", c)
			}
			if c != nil {
				t.Error("config returned with error")
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q\ndoes not contain %q", err, w)
				}
			}
		})
	}
}

func TestParseFlagsHelp(t *testing.T) {
	for _, arg := range []string{"-h", "-help", "--help"} {
		_, err := ParseFlags([]string{arg}, envFunc(nil))
		if !errors.Is(err, flag.ErrHelp) {
			t.Fatalf("%s: err = %v", arg, err)
		}
		for _, w := range []string{
			"Usage: sluice-agent", "-config", "-server", "-token-file", "-insecure", "-ca-file",
			"-log-level", "-max-connections", "-upstream", "-id", "-shutdown-grace", EnvShutdownGrace,
			"-disable-data-lane", EnvDisableLane, "-admin-listen", EnvAdminListen,
			"-cert-file", EnvCertFile, "-key-file", EnvKeyFile,
			EnvConfig, EnvServer, EnvToken, EnvTokenFile, EnvID, EnvInsecure, EnvCAFile,
			EnvLogLevel, EnvMaxConnections, EnvTunnelBudget, EnvUpstreams, "*=TARGET", "host=app.example.com,target=",
			"a setting given as a flag overrides the environment", "Upstreams are combined instead",
			"https targets are always spoken to over HTTP/1.1",
		} {
			if !strings.Contains(err.Error(), w) {
				t.Errorf("%s: usage does not mention %q:\n%s", arg, w, err)
			}
		}
	}
}

// TestVersionFlag: -version in any spelling the flag package takes asks for
// the version, before the rest of the configuration is checked.
func TestVersionFlag(t *testing.T) {
	for _, args := range [][]string{{"-version"}, {"--version"}, {"-version=true", "-server", "nonsense"}} {
		if _, err := ParseFlags(args, func(string) string { return "" }); !errors.Is(err, ErrVersion) {
			t.Errorf("%q: err = %v, want ErrVersion", args, err)
		}
	}
	if _, err := ParseFlags([]string{"-version=false"}, func(string) string { return "" }); errors.Is(err, ErrVersion) {
		t.Error("-version=false asked for the version")
	}
}

// TestUpstreamErrorsNameTheirSource: an upstream from SLUICE_UPSTREAMS or
// -upstream is named by its place there, not by its index in the merged
// list (which is in no source the user wrote).
func TestUpstreamErrorsNameTheirSource(t *testing.T) {
	file := writeFile(t, "agent.yaml", "server: grpc://a:1\ntoken: t\nupstreams:\n  - host: a.test\n    target: http://a:1\n")
	env := map[string]string{EnvConfig: file, EnvUpstreams: "b.test=http://b:1;c.test=http://x"}
	_, err := ParseFlags([]string{"-upstream", "a.test=http://d:1"}, envFunc(env))
	if err == nil {
		t.Fatal("no error")
	}
	for _, want := range []string{
		`SLUICE_UPSTREAMS[1].target: "http://x": port required`,
		`-upstream[0].name: duplicate name "a.test" (also upstreams[0];`,
	} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not contain %q", err, want)
		}
	}
}

// TestDisableSwitchesLayers: disable_data_lane, disable_direct_sockets
// and server_each_address come from the file, the environment and the flag, each over the one
// before; an environment value that is not a boolean is refused.
func TestDisableSwitchesLayers(t *testing.T) {
	for _, sw := range []struct {
		key, flag, env string
		get            func(*Config) bool
	}{
		{"disable_data_lane", "-disable-data-lane", EnvDisableLane, func(c *Config) bool { return c.DisableDataLane }},
		{"disable_direct_sockets", "-disable-direct-sockets", EnvDisableDirect, func(c *Config) bool { return c.DisableDirectSockets }},
		{"server_each_address", "-server-each-address", EnvServerEach, func(c *Config) bool { return c.ServerEachAddress }},
	} {
		file := filepath.Join(t.TempDir(), "agent.yaml")
		yaml := "server: grpc://n:1\ntoken: t\n" + sw.key + ": true\nupstreams:\n  - host: a\n    target: http://a:1\n"
		if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
			t.Fatal(err)
		}
		noFile := []string{"-server", "grpc://n:1", "-token", "t", "-upstream", "a=http://a:1"}
		for _, tc := range []struct {
			name string
			args []string
			env  map[string]string
			want bool
		}{
			{"file", []string{"-config", file}, nil, true},
			{"env over file", []string{"-config", file}, map[string]string{sw.env: "false"}, false},
			{"flag over env", []string{"-config", file, sw.flag}, map[string]string{sw.env: "false"}, true},
			{"flag false over file", []string{"-config", file, sw.flag + "=false"}, nil, false},
			{"env alone", noFile, map[string]string{sw.env: "1"}, true},
		} {
			c, err := ParseFlags(tc.args, envFunc(tc.env))
			if err != nil {
				t.Fatalf("%s, %s: %v", sw.key, tc.name, err)
			}
			if got := sw.get(c); got != tc.want {
				t.Errorf("%s, %s: %v, want %v", sw.key, tc.name, got, tc.want)
			}
		}
		if _, err := ParseFlags(noFile, envFunc(map[string]string{sw.env: "sometimes"})); err == nil {
			t.Errorf("bad %s accepted", sw.env)
		}
	}
}

// TestServerRefreshLayers: server_refresh comes from the file, the
// environment and the flag, each over the one before; it defaults to 30 s
// and takes no less than a second.
func TestServerRefreshLayers(t *testing.T) {
	file := filepath.Join(t.TempDir(), "agent.yaml")
	yaml := "server: grpc://n:1\ntoken: t\nserver_each_address: true\nserver_refresh: 5s\nupstreams:\n  - host: a\n    target: http://a:1\n"
	if err := os.WriteFile(file, []byte(yaml), 0o600); err != nil {
		t.Fatal(err)
	}
	noFile := []string{"-server", "grpc://n:1", "-token", "t", "-upstream", "a=http://a:1"}
	for _, tc := range []struct {
		name string
		args []string
		env  map[string]string
		want time.Duration
	}{
		{"file", []string{"-config", file}, nil, 5 * time.Second},
		{"env over file", []string{"-config", file}, map[string]string{EnvServerRefresh: "7s"}, 7 * time.Second},
		{"flag over env", []string{"-config", file, "-server-refresh", "1m"}, map[string]string{EnvServerRefresh: "7s"}, time.Minute},
		{"default", noFile, nil, DefaultServerRefresh},
	} {
		c, err := ParseFlags(tc.args, envFunc(tc.env))
		if err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if c.ServerRefresh != tc.want {
			t.Errorf("%s: server_refresh %v, want %v", tc.name, c.ServerRefresh, tc.want)
		}
	}
	for _, bad := range []map[string]string{{EnvServerRefresh: "500ms"}, {EnvServerRefresh: "-1s"}, {EnvServerRefresh: "soon"}} {
		_, err := ParseFlags(noFile, envFunc(bad))
		if err == nil || !strings.Contains(err.Error(), "server_refresh") && !strings.Contains(err.Error(), EnvServerRefresh) {
			t.Errorf("%v: err %v, want one naming server_refresh", bad, err)
		}
	}
}

package tunnelpb

import (
	"runtime/debug"
	"strings"
	"testing"
)

// TestWriteBuildInfo: the main module, sluice as a replaced dependency
// (an xcaddy build of a checkout), the extra modules asked for and the
// VCS stamp each get their line; other dependencies and settings do not.
func TestWriteBuildInfo(t *testing.T) {
	bi := &debug.BuildInfo{
		Path: "caddy",
		Main: debug.Module{Path: "caddy", Version: "(devel)"},
		Deps: []*debug.Module{
			{Path: "github.com/caddyserver/caddy/v2", Version: "v2.11.9", Sum: "h1:abc="},
			{Path: ModulePath, Version: "v0.0.0-00010101000000-000000000000", Replace: &debug.Module{Path: "/src/sluice"}},
			{Path: "golang.org/x/net", Version: "v0.62.0"},
		},
		Settings: []debug.BuildSetting{{Key: "vcs.revision", Value: "deadbeef"}, {Key: "vcs.modified", Value: "true"}, {Key: "GOOS", Value: "linux"}},
	}
	var b strings.Builder
	writeBuildInfo(&b, bi, []string{"github.com/caddyserver/caddy/v2"})
	want := "path caddy\n" +
		"module " + ModulePath + " v0.0.0-00010101000000-000000000000 => /src/sluice\n" +
		"module github.com/caddyserver/caddy/v2 v2.11.9 h1:abc=\n" +
		"vcs.revision deadbeef\n" +
		"vcs.modified true\n"
	if got := b.String(); got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}

	// sluice-agent: sluice is the main module.
	b.Reset()
	writeBuildInfo(&b, &debug.BuildInfo{Path: ModulePath + "/agent/cmd/sluice-agent", Main: debug.Module{Path: ModulePath, Version: "v1.2.3", Sum: "h1:x="}}, nil)
	if got, want := b.String(), "path "+ModulePath+"/agent/cmd/sluice-agent\nmodule "+ModulePath+" v1.2.3 h1:x=\n"; got != want {
		t.Errorf("got\n%s\nwant\n%s", got, want)
	}
}

// TestVersionText: the first line is the build line.
func TestVersionText(t *testing.T) {
	got := VersionText("sluice-agent", "v9.9.9")
	if first, _, _ := strings.Cut(got, "\n"); first != Build("sluice-agent", "v9.9.9") {
		t.Errorf("first line %q", first)
	}
}

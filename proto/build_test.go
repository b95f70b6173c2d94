package tunnelpb

import (
	"runtime"
	"runtime/debug"
	"testing"
)

// TestVersionIn: sluice's version is found as the main module (the agent's
// binary) or as a dependency (a Caddy built with xcaddy, replaced or not).
func TestVersionIn(t *testing.T) {
	for _, tc := range []struct {
		name string
		bi   debug.BuildInfo
		want string
	}{
		{"main", debug.BuildInfo{Main: debug.Module{Path: ModulePath, Version: "v1.2.3"}}, "v1.2.3"},
		{"devel", debug.BuildInfo{Main: debug.Module{Path: ModulePath, Version: "(devel)"}}, ""},
		{"dependency", debug.BuildInfo{Main: debug.Module{Path: "caddy", Version: "v2.0.0"},
			Deps: []*debug.Module{{Path: ModulePath, Version: "v0.4.0"}}}, "v0.4.0"},
		{"replaced", debug.BuildInfo{Main: debug.Module{Path: "caddy"},
			Deps: []*debug.Module{{Path: ModulePath, Version: "v0.4.0", Replace: &debug.Module{Path: "../sluice", Version: "v0.4.1"}}}}, "v0.4.1"},
		{"absent", debug.BuildInfo{Main: debug.Module{Path: "other", Version: "v9.0.0"}}, ""},
	} {
		if got := versionIn(&tc.bi); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}

func TestBuild(t *testing.T) {
	if got, want := Build("sluice-node", "v1.0.0"), "sluice-node v1.0.0 ("+runtime.Version()+")"; got != want {
		t.Errorf("%q, want %q", got, want)
	}
	// A test binary's main module is sluice at "(devel)": no version.
	if got, want := Build("sluice-agent", ""), "sluice-agent devel ("+runtime.Version()+")"; got != want {
		t.Errorf("%q, want %q", got, want)
	}
}

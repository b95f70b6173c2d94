package caddymodule

import "testing"

func TestMediaTypeMatches(t *testing.T) {
	sse := []string{"text/event-stream"}
	for _, tc := range []struct {
		header string
		types  []string
		want   bool
	}{
		{"text/event-stream", sse, true},
		{"application/json, text/event-stream", sse, true},
		{"TEXT/EVENT-STREAM; q=1.0", sse, true},
		{"text/event-stream; charset=utf-8", sse, true},
		{"  text/event-stream  ", sse, true},
		{"text/event-streams", sse, false},            // whole value, not a prefix
		{"application/text/event-stream", sse, false}, // not a substring
		{"text/*", sse, false},
		{"", sse, false},
		{"text/event-stream", nil, false}, // empty list disables
		{"application/x-ndjson", []string{"text/event-stream", "application/x-ndjson"}, true},
	} {
		if got := mediaTypeMatches(tc.header, tc.types); got != tc.want {
			t.Errorf("mediaTypeMatches(%q, %v) = %v, want %v", tc.header, tc.types, got, tc.want)
		}
	}
}

func TestPathPrefixMatches(t *testing.T) {
	prefixes := []string{"/events", ""}
	for path, want := range map[string]bool{"/events": true, "/events/x": true, "/eventsource": true, "/api/events": false, "/": false} {
		if got := pathPrefixMatches(path, prefixes); got != want {
			t.Errorf("pathPrefixMatches(%q) = %v, want %v", path, got, want)
		}
	}
	if pathPrefixMatches("/anything", []string{""}) {
		t.Error("an empty prefix must never match")
	}
}

func TestStreamPolicyDefaultsAndValidation(t *testing.T) {
	var p StreamPolicy
	if got := p.responseTypes(); len(got) != 1 || got[0] != "text/event-stream" {
		t.Fatalf("default response types %v", got)
	}
	empty := []string{}
	p.StreamRequestAcceptTypes = &empty
	if len(p.acceptTypes()) != 0 {
		t.Fatal("an explicit empty list must disable Accept classification")
	}
	bad := []string{"text/event-stream; charset=utf-8"}
	p.StreamResponseContentTypes = &bad
	if p.validate() == nil {
		t.Fatal("media types with parameters must be rejected")
	}
	p = StreamPolicy{StreamIdleTimeout: -1}
	if p.validate() == nil {
		t.Fatal("negative durations must be rejected")
	}
}

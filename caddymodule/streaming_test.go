package caddymodule

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
)

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

// TestResponseHeaderTimeoutDefault: unset is DefaultResponseHeaderTimeout
// (60 s), 0 is off, a negative value is refused naming the field.
func TestResponseHeaderTimeoutDefault(t *testing.T) {
	var p StreamPolicy
	if got := p.responseHeaderTimeout(); got != 60*time.Second {
		t.Fatalf("default %v, want 60s", got)
	}
	p.ResponseHeaderTimeout = new(caddy.Duration(0))
	if got := p.responseHeaderTimeout(); got != 0 {
		t.Fatalf("0 must turn it off, got %v", got)
	}
	p.ResponseHeaderTimeout = new(caddy.Duration(-time.Second))
	if err := p.validate(); err == nil || !strings.Contains(err.Error(), "response_header_timeout") {
		t.Fatalf("negative: %v, want an error naming response_header_timeout", err)
	}
}

// newHeadExchange is an exchange timing its response head with wait.
func newHeadExchange(wait time.Duration) (*exchange, context.Context) {
	ctx, cancel := context.WithCancelCause(context.Background())
	x := &exchange{policy: &StreamPolicy{}, start: time.Now(), cancel: cancel, headWait: wait}
	x.armHeadLocked()
	return x, ctx
}

// TestHeadTimer: the response_header_timeout cancels the exchange with
// errHeaderTimeout when no head comes, is paused while a body read waits
// for the client, and stops for good with the head.
func TestHeadTimer(t *testing.T) {
	const wait = 50 * time.Millisecond
	t.Run("fires without a head", func(t *testing.T) {
		x, ctx := newHeadExchange(wait)
		defer x.stop()
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the head timer never fired")
		}
		if !errors.Is(context.Cause(ctx), errHeaderTimeout) {
			t.Fatalf("cause %v, want errHeaderTimeout", context.Cause(ctx))
		}
	})
	t.Run("paused while the body waits for the client", func(t *testing.T) {
		x, ctx := newHeadExchange(wait)
		defer x.stop()
		x.bodyReadStart()
		select {
		case <-ctx.Done():
			t.Fatalf("fired during a body read: %v", context.Cause(ctx))
		case <-time.After(8 * wait):
		}
		x.bodyReadEnd() // starts over in full
		select {
		case <-ctx.Done():
		case <-time.After(10 * time.Second):
			t.Fatal("the head timer never fired after the body read")
		}
	})
	t.Run("stopped by the head", func(t *testing.T) {
		x, ctx := newHeadExchange(wait)
		defer x.stop()
		x.onResponse(200, http.Header{})
		x.bodyReadStart() // a late body read must not arm it again
		x.bodyReadEnd()
		select {
		case <-ctx.Done():
			t.Fatalf("fired after the head: %v", context.Cause(ctx))
		case <-time.After(8 * wait):
		}
	})
	t.Run("off", func(t *testing.T) {
		x, ctx := newHeadExchange(0)
		defer x.stop()
		x.bodyReadStart()
		x.bodyReadEnd()
		if x.headTimer != nil || ctx.Err() != nil {
			t.Fatal("a 0 response_header_timeout must arm nothing")
		}
	})
}

// TestHeadWaitForGRPC: a gRPC call (any application/grpc content type) has
// no response_header_timeout, since a server-streaming call may send its
// head with its first message; every other exchange has the policy's.
func TestHeadWaitForGRPC(t *testing.T) {
	p := &StreamPolicy{ResponseHeaderTimeout: new(caddy.Duration(5 * time.Second))}
	for ct, want := range map[string]time.Duration{
		"":                            5 * time.Second,
		"application/json":            5 * time.Second,
		"application/gr":              5 * time.Second,
		"application/grpc":            0,
		"application/grpc+proto":      0,
		"Application/GRPC-web+proto":  0,
		"application/grpc; charset=x": 0,
		"text/event-stream":           5 * time.Second,
	} {
		r, _ := http.NewRequest("POST", "http://app.test/", nil)
		if ct != "" {
			r.Header.Set("Content-Type", ct)
		}
		if got := headWaitFor(r, p); got != want {
			t.Errorf("Content-Type %q: %v, want %v", ct, got, want)
		}
	}
}
